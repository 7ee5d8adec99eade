"""Progress on stderr that keeps moving: a tqdm bar whose elapsed time ticks every second, also
while one long step (dequantizing, tracing, saving, quantizing, loading a session) holds the
caller, with the step named in full. Nothing at all is drawn when quiet.

Off a terminal (a log file, CI) redraws would pile up as hundreds of lines: there a stage writes
whole lines instead, when it starts, when a step starts, at most every LOG_INTERVAL_S in between,
and when it ends (LineBar)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

TICK_S = 1.0
LOG_INTERVAL_S = 30.0  # off a terminal: the most often a line repeats within one step


def on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


class LineBar:
    """The part of tqdm's interface used here, for stderr that is not a terminal: one line per
    stage start, step start (set_description_str), first status (set_postfix_str) and end
    (close); counts, later statuses and ticks (refresh) write a line only once LOG_INTERVAL_S has
    passed since the last one."""

    def __init__(self, desc: str, total: int | None = None):
        self.desc, self.total, self.n, self.postfix = desc, total, 0, ""
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._emit()

    def _emit(self) -> None:
        from tqdm import tqdm

        self.last = time.monotonic()
        count = f" {self.n}/{self.total}" if self.total else ""
        status = f" ({self.postfix})" if self.postfix else ""
        line = f"{self.desc}{count}{status} [{tqdm.format_interval(self.last - self.t0)}]"
        print(line, file=sys.stderr, flush=True)

    def refresh(self) -> None:
        with self._lock:
            if not self._closed and time.monotonic() - self.last >= LOG_INTERVAL_S:
                self._emit()

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        changed, self.desc = desc != self.desc, desc
        if changed and refresh:
            with self._lock:
                self._emit()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        first, self.postfix = not self.postfix, s
        if first and s:  # the first status is news; later ones wait for the interval
            with self._lock:
                self._emit()
        else:
            self.refresh()

    def write(self, s: str, file=None) -> None:
        print(s, file=file or sys.stderr, flush=True)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._emit()


def new_bar(desc: str, total: int | None = None, *, disable: bool = False, **tqdm_options):
    """A tqdm bar on a terminal, a LineBar elsewhere (tqdm's own disabled bar when `disable`)."""
    from tqdm import tqdm

    if disable:
        return tqdm(total=total, desc=desc, disable=True)
    if not on_terminal():
        return LineBar(desc, total)
    return tqdm(total=total, desc=desc, file=sys.stderr, **tqdm_options)


@contextlib.contextmanager
def ticking(bar):
    """Redraw a tqdm bar every second while the block runs: the bar itself redraws only when it is
    updated, so a long step in between would freeze its timer."""
    stop = threading.Event()

    def tick():
        while not stop.wait(TICK_S):
            bar.refresh()

    thread = threading.Thread(target=tick, name="specedge-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()


def _size_overrides() -> dict:
    """tqdm trims each line to the terminal's width (a wrapped line would break the redraw) and
    hides bars beyond its height; a terminal that reports no size (a bare pseudo-terminal) would
    show nothing at all, so it is given a wide one."""
    try:
        fd = sys.stderr.fileno()
        if os.isatty(fd) and os.get_terminal_size(fd).columns == 0:
            return {"ncols": 500, "nrows": 50}
    except (AttributeError, ValueError, OSError):  # a replaced stderr
        pass
    return {}


class TickingBar:
    """One stage: `with TickingBar(name, total) as b: b.update(1, "step")`; nothing drawn when quiet,
    and the line is erased at the end unless `leave`."""

    def __init__(self, name: str, total: int | None = None, quiet: bool = False, leave: bool = True):
        self.name, self.total, self.quiet, self.leave = name, total, quiet, leave
        self.bar = None
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if self.quiet:
            return self
        fmt = "{desc} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]" if self.total else "{desc} [{elapsed}]"
        self.bar = new_bar(self.name, self.total, leave=self.leave, bar_format=fmt, **_size_overrides())
        self._stack.enter_context(ticking(self.bar))
        return self

    def step(self, msg: str | None) -> None:
        """Name what is happening now (the stage's name, then the step, never cut)."""
        if self.bar is not None:
            self.bar.set_description_str(f"{self.name}: {msg}" if msg else self.name, refresh=True)

    def status(self, msg: str | None) -> None:
        """Name how the current step is going (a loss, an ETA): on a terminal as step() does; off
        one, written at most every LOG_INTERVAL_S."""
        if isinstance(self.bar, LineBar):
            self.bar.set_postfix_str(msg or "")
        else:
            self.step(msg)

    def update(self, n: int = 1, msg: str | None = None) -> None:
        if self.bar is None:
            return
        if msg:
            self.step(msg)
        if n:
            self.bar.update(n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self._stack.close()
            self.bar.set_description_str(self.name, refresh=False)
            self.bar.close()
        return False
