"""Progress on stderr that keeps moving: a tqdm bar whose elapsed time ticks every second, also
while one long step (dequantizing, tracing, saving, quantizing, loading a session) holds the
caller, with the step named in full. Nothing at all is drawn when quiet."""

from __future__ import annotations

import sys
import threading

TICK_S = 1.0


class TickingBar:
    def __init__(self, name: str, total: int | None = None, quiet: bool = False, unit: str = "step"):
        self.name, self.total, self.quiet, self.unit = name, total, quiet, unit
        self.bar = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        if self.quiet:
            return self
        from tqdm import tqdm

        counts = " {n_fmt}/{total_fmt}" if self.total else ""
        self.bar = tqdm(total=self.total, desc=self.name, file=sys.stderr, leave=True, unit=self.unit,
                        bar_format="{desc} {bar:20}" + counts + " [{elapsed}]" if self.total
                        else "{desc} [{elapsed}]")
        # The bar itself redraws only when it is updated; a long step in between would freeze the timer.
        self._thread = threading.Thread(target=self._tick, name="specedge-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self.bar.refresh()

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
            self._stop.set()
            self._thread.join()
            self.bar.set_description_str(self.name, refresh=False)
            self.bar.close()
        return False
