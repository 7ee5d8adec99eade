"""How `load` assembles a pipeline (docs/design.md, runtime roles): backends declare the session
options they take (no signature introspection), one factory picks the drafter class, the target's
cache tracker pads single-token steps, and the seeded-sampling costs are named once."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from specedge.contract import MAX_SPEC_TOKENS, NGRAM_SIZES
from specedge.manifest import load_manifest
from specedge.runtime.api import load
from specedge.runtime.backends import Backend, BackendError, SessionOptions
from specedge.runtime.backends.ort import OrtBackend
from specedge.runtime.backends.ort_cuda import OrtCudaBackend, OrtTrtBackend
from specedge.runtime.cache import CacheTracker
from specedge.runtime.drafters import DRAFTERS, check_draft_name, drafter_class
from specedge.runtime.drafters.head import HeadDrafter
from specedge.runtime.drafters.model import ModelDrafter
from specedge.runtime.drafters.ngram import NgramDrafter
from specedge.runtime.policy import draft_step_cost, static_cost_model

RUNTIME = Path(__file__).resolve().parents[1] / "specedge" / "runtime"


class _Spec:
    role, kind, precision, vocab_size = "target", "model", "fp32", 8


class _Manifest:
    max_seq, kv_mode = 16, "scatter"


class _Fake(Backend):
    """A backend whose constructor takes anything (**kwargs): what it gets is only what it says."""

    name = "fake"

    def __init__(self, manifest, spec, *, cuda_graphs: bool = True, **kwargs):
        super().__init__(manifest, spec)
        self.cuda_graphs, self.kwargs = cuda_graphs, kwargs

    def run(self, input_ids, position):
        return np.zeros((len(input_ids), 8), np.float32)


def test_a_backend_gets_only_the_session_options_it_declares():
    session = SessionOptions(threads=2, allow_spinning=False, alternating=True, shared_pool=True)
    b = _Fake.open(_Manifest(), _Spec(), session, {"cuda_graphs": False})
    assert b.kwargs == {} and b.cuda_graphs is False
    assert set(OrtBackend.session_kwargs(session)) == {
        "threads",
        "providers",
        "allow_spinning",
        "alternating",
        "shared_pool",
        "int4_kernel",
    }
    # ort-trt takes what ort-cuda takes, none of the CPU session options (its **kwargs once made
    # load pass them all on, and OrtCudaBackend refuse them)
    assert OrtCudaBackend.session_kwargs(session) == {} and OrtTrtBackend.session_kwargs(session) == {}


def test_backend_options_may_not_repeat_a_session_option(tiny_bundle_factory):
    with pytest.raises(BackendError) as e:
        load(tiny_bundle_factory(), threads=1, verify="none", backend_options={"threads": 2})
    assert str(e.value) == "backend_options may not set threads: load() sets it for backend 'ort-cpu'"


def test_providers_are_refused_by_a_backend_that_takes_none():
    with pytest.raises(BackendError, match="backend 'fake' does not take providers"):
        _Fake.open(_Manifest(), _Spec(), SessionOptions(providers=["CPUExecutionProvider"]))


def test_the_runtime_reads_no_signatures_and_unwraps_nothing():
    for path in RUNTIME.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "inspect.signature" not in text, path
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
                assert not (isinstance(node.args[1], ast.Constant) and node.args[1].value == "inner"), path


def test_one_factory_picks_the_drafter(tiny_bundle_factory):
    assert DRAFTERS == {"model": ModelDrafter, "ngram": NgramDrafter, "head": HeadDrafter}
    with pytest.raises(ValueError) as e:
        check_draft_name("eagle")
    assert str(e.value) == "draft must be 'model', 'ngram', 'head' or None, got 'eagle'"
    ngram = load_manifest(tiny_bundle_factory(draft="ngram"), verify="none")
    selfdraft = load_manifest(tiny_bundle_factory(), verify="none")
    assert drafter_class(None, ngram) is NgramDrafter and drafter_class(None, selfdraft) is ModelDrafter
    with pytest.raises(ValueError, match="this bundle's draft is an n-gram drafter: it has no draft model"):
        drafter_class("model", ngram)
    with pytest.raises(ValueError, match="this bundle has no draft head: train one"):
        drafter_class("head", selfdraft)
    d = NgramDrafter.from_bundle(ngram, None, 50)
    assert d.index.ngram_sizes == tuple(ngram.draft.extra["ngram_sizes"]) and d.vocab == 50
    assert NgramDrafter.from_bundle(selfdraft, None, 50).index.ngram_sizes == NGRAM_SIZES
    with pytest.raises(BackendError, match="a draft head runs on the ort-cpu backend"):
        HeadDrafter.backend_name("ort-cpu", "torch")
    assert ModelDrafter.backend_name("ort-cpu", None) == "ort-cpu" and NgramDrafter.backend_name("ort-cpu", "x") is None


def test_the_ngram_drafter_refuses_the_index_arguments():
    # NgramDrafter was the index's name: its old call (sizes first) must not pass as a vocabulary
    with pytest.raises(ValueError) as e:
        NgramDrafter((3, 2, 1))
    assert str(e.value) == "vocab must be a positive integer, got (3, 2, 1)"


class _Spy:
    max_seq = 8
    vocab_size = 4

    def __init__(self):
        self.calls = []

    def run(self, ids, position):
        self.calls.append((list(np.asarray(ids)), position))
        return np.arange(len(ids) * 4, dtype=np.float32).reshape(len(ids), 4)

    def argmax(self, ids, position):
        return np.argmax(self.run(ids, position), axis=-1)


def test_the_target_tracker_pads_single_token_steps_and_records_one_token():
    spy = _Spy()
    c = CacheTracker(spy, 2, invariant_steps=True)
    c.feed_chunked([5, 6, 7])  # chunks of 2 and 1: the lone last token is padded too
    assert c.feed([8]).shape == (1, 4)
    assert c.feed_argmax([9]).tolist() == [3]
    c.adopt([2, 3])
    c.feed([1])  # the last slot: no room for the padding token
    assert spy.calls == [([5, 6], 0), ([7, 0], 2), ([8, 0], 3), ([9, 0], 4), ([1], 7)]
    assert c.tokens == [5, 6, 7, 8, 9, 2, 3, 1] and c.position == 8
    plain = CacheTracker(_Spy(), 2)
    plain.feed([8])
    assert plain.backend.calls == [([8], 0)]


def test_seeded_sampling_costs_are_named_once(tiny_bundle_factory):
    costs = static_cost_model(0.5)
    assert costs.target == {1: 1.0, MAX_SPEC_TOKENS + 1: 1.8} and costs.draft == 0.5
    assert draft_step_cost(10, 1000) == 0.02 and draft_step_cost(500, 1000) == 0.5 and draft_step_cost(0, 10) == 0.3
    pipe = load(tiny_bundle_factory(draft="ngram"), threads=1, verify="none", warmup=False)
    try:
        assert pipe.generator.static_costs.draft == 0.01
    finally:
        pipe.close()


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--max-new-tokens", "0"], "max_new_tokens", 0),
        (["--temperature", "-1"], "temperature", -1.0),
        (["--temperature", "inf"], "temperature", float("inf")),
        (["--top-p", "0"], "top_p", 0.0),
        (["--top-k", "-1"], "top_k", -1),
        (["--seed", "-1"], "seed", -1),
        (["--spec-tokens", "17"], "spec_tokens", 17),
        (["--stop", ""], "stop", [""]),
    ],
)
def test_the_cli_checks_a_request_with_the_runtimes_one_check(flags, field, value):
    """generate/chat refuse a request's settings with GenerationConfig.validate's sentence, the
    flag in place of the field: one rule, three callers (CLI, Pipeline, server)."""
    import argparse

    from specedge.cli.generate import check_args, register
    from specedge.errors import UserError
    from specedge.runtime.requests import CLI_FLAGS, GenerationConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["generate", "BUNDLE", "hi", *flags])
    with pytest.raises(UserError) as cli:
        check_args(args)
    with pytest.raises(ValueError) as api:
        GenerationConfig(**{field: value}).validate()
    shown = "spec_tokens (k)" if field == "spec_tokens" else field
    assert str(cli.value) == str(api.value).replace(shown, CLI_FLAGS[field], 1)
