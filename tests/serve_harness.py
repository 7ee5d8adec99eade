"""`specedge serve` in a subprocess whose replicas' target calls can be held, for the shutdown
tests (signals need a process of their own). Usage: python serve_harness.py SERVE-ARGS...

Once SPECEDGE_TEST_FREE target calls have run, a call waits while the file SPECEDGE_TEST_HOLD
exists (at most two minutes), after creating HOLD + ".held"; deleting HOLD lets it go on. With
SPECEDGE_TEST_LOAD_HOLD the model load ends only once that file is gone. The server itself is the
real command: only the load and the backend calls are wrapped."""

from __future__ import annotations

import os
import sys
import time

import specedge.cli.serve as serve_cli
from specedge.cli.main import exit_process, main

HOLD = os.environ["SPECEDGE_TEST_HOLD"]
FREE = int(os.environ.get("SPECEDGE_TEST_FREE", "0"))
_calls = 0


def _wrap(fn):
    def call(*a, **kw):
        global _calls
        _calls += 1
        if _calls > FREE and os.path.exists(HOLD):
            open(HOLD + ".held", "w").close()
            end = time.monotonic() + 120
            while os.path.exists(HOLD) and time.monotonic() < end:
                time.sleep(0.01)
        return fn(*a, **kw)

    return call


_load = serve_cli.load_replicas


def _load_gated(args):
    pipes = _load(args)
    loading = os.environ.get("SPECEDGE_TEST_LOAD_HOLD")  # the load "lasts" while this file exists
    if loading:
        open(loading + ".loading", "w").close()
        end = time.monotonic() + 120
        try:
            while os.path.exists(loading) and time.monotonic() < end:
                time.sleep(0.01)
        except BaseException:
            for p in pipes:
                p.close()
            raise
    for p in pipes:
        backend = p.generator.target.backend
        for name in ("run", "argmax"):
            if hasattr(backend, name):
                setattr(backend, name, _wrap(getattr(backend, name)))
    return pipes


serve_cli.load_replicas = _load_gated

if __name__ == "__main__":
    exit_process(main(["serve", *sys.argv[1:]]))
