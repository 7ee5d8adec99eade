"""Progress on stderr that keeps moving: a tqdm bar whose elapsed time ticks every second, also
while one long step (dequantizing, tracing, saving, quantizing, loading a session) holds the
caller, with the step named in full. Nothing at all is drawn when quiet."""

from __future__ import annotations

import contextlib
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


class TickingBar:
    """One stage: `with TickingBar(name, total) as b: b.update(1, "step")`; nothing drawn when quiet."""

    def __init__(self, name: str, total: int | None = None, quiet: bool = False):
        self.name, self.total, self.quiet = name, total, quiet
        self.bar = None
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if self.quiet:
            return self
        from tqdm import tqdm

        fmt = "{desc} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]" if self.total else "{desc} [{elapsed}]"
        self.bar = tqdm(total=self.total, desc=self.name, file=sys.stderr, leave=True, bar_format=fmt)
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
