"""Progress on stderr that keeps moving: a tqdm bar whose elapsed time ticks every second, also
while one long step (dequantizing, tracing, saving, quantizing, loading a session) holds the
caller, with the step named in full. Nothing at all is drawn when quiet."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

TICK_S = 1.0


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
        from tqdm import tqdm

        fmt = "{desc} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]" if self.total else "{desc} [{elapsed}]"
        self.bar = tqdm(
            total=self.total, desc=self.name, file=sys.stderr, leave=self.leave, bar_format=fmt, **_size_overrides()
        )
        self._stack.enter_context(ticking(self.bar))
        return self

    def step(self, msg: str | None) -> None:
        """Name what is happening now (the stage's name, then the step, never cut)."""
        if self.bar is not None:
            self.bar.set_description_str(f"{self.name}: {msg}" if msg else self.name, refresh=True)

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
