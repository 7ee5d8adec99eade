"""The GPU check's steps, run in a fixed order, each under its own time budget.

A step is a function of one dict, its record in report["steps"], which it fills as it measures.
The report is written to disk before and after every step (and whenever a step calls save()), so
a call stopped by its time limit still returns everything measured until then. A step that raises,
or outlives its budget, or sets record["ok"] = False is recorded as such and the next step runs;
a step whose budget no longer fits in the total is skipped and says so.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

MIN_STEP_S = 5.0  # a step left less than this is skipped, not started


class StepTimeout(BaseException):
    """Raised in a step at the end of its budget. A BaseException, so that the steps' own
    `except Exception` handlers (one backend failing must not hide the others) let it through."""


class Skip(Exception):
    """Raised by a step that has nothing to check here (no GPU, no package, no bundle)."""


class Stopped(BaseException):
    """The whole run was told to stop (SIGTERM from `timeout`, or the device call's limit)."""


def stop_on_sigterm() -> None:
    """Turn SIGTERM into Stopped, so that the step in progress is recorded and the table printed."""

    def handler(signum, frame):
        raise Stopped()

    signal.signal(signal.SIGTERM, handler)


class Step:
    """A name, a time budget in seconds and a function of the step's record."""

    def __init__(self, name: str, budget_s: float, fn: Callable[[dict], None]):
        self.name, self.budget_s, self.fn = name, budget_s, fn


class StepRunner:
    def __init__(self, path: Path, report: dict, total_s: float, log=print, clock=time.monotonic):
        self.path = Path(path)
        self.report = report
        self.report.setdefault("steps", {})
        self.clock = clock
        self.deadline = clock() + total_s
        self.log = log

    def save(self) -> None:
        """Write the report (a whole file or none: a kill mid-write leaves the previous one)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str))
        os.replace(tmp, self.path)

    def left(self) -> float:
        return self.deadline - self.clock()

    @contextmanager
    def waiting(self, rec: dict):
        """Time a step spends in here, waiting on work running in the background (an export),
        does not count against its own budget; the total still bounds it. rec["waited_s"] says
        how long it waited."""
        remaining, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        if remaining > 0:  # inside a step: bounded by the total meanwhile
            signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.01))
        t0 = self.clock()
        try:
            yield
        finally:
            rec["waited_s"] = round(rec.get("waited_s", 0) + self.clock() - t0, 2)
        if remaining > 0:  # back to what was left of the step's budget (reached on a normal exit only)
            signal.setitimer(signal.ITIMER_REAL, max(min(remaining, self.left()), 0.01))

    def run(self, steps: list[Step]) -> dict:
        for st in steps:
            rec = self.report["steps"][st.name] = {"status": "running", "budget_s": st.budget_s}
            left = self.left()
            if left < min(st.budget_s, MIN_STEP_S):
                rec.update(status="skipped", reason=f"out of time ({max(left, 0):.0f} s of the total left)")
                self.log(f"{st.name}: skipped, out of time")
                self.save()
                continue
            budget = min(st.budget_s, left)
            rec["budget_s"] = round(budget, 1)
            self.save()
            t0 = self.clock()

            armed = [True]  # disarmed once the step has returned or raised: the bookkeeping below runs whole

            def expire(signum, frame):
                if armed[0]:
                    raise StepTimeout()

            old = signal.signal(signal.SIGALRM, expire)
            signal.setitimer(signal.ITIMER_REAL, budget)
            try:
                try:
                    st.fn(rec)
                finally:
                    armed[0] = False
                rec["status"] = "ok" if rec.get("ok", True) else "failed"
            except StepTimeout:
                rec["status"] = "timeout"
                rec["error"] = f"stopped at its budget of {round(budget, 1):g} s"
            except Skip as e:
                rec["status"] = "skipped"
                rec["reason"] = str(e)
            except Exception as e:  # noqa: BLE001 - recorded; the next step runs
                rec["status"] = "error"
                rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                rec["traceback"] = traceback.format_exc(limit=8)
            except BaseException as e:  # SIGTERM (see stop_on_sigterm), Ctrl-C: recorded, then the run ends
                rec.update(status="stopped", error=type(e).__name__, seconds=round(self.clock() - t0, 2))
                self.save()
                raise
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
            rec["seconds"] = round(self.clock() - t0, 2)
            detail = rec.get("error") or rec.get("reason") or ""
            self.log(f"{st.name}: {rec['status']} in {rec['seconds']:.1f} s{': ' + detail if detail else ''}")
            self.save()
        return self.report
