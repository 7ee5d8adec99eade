"""The runtime's named roles on their own: the drafter protocol and its proposal type, the cache
state, one round as a function, text with stop strings, the shared backend checks, the contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specedge.contract import ARGMAX_OUTPUT, MAX_SPEC_TOKENS, expected_names, parse_kv_name, reserved_call_size
from specedge.errors import BackendError
from specedge.manifest import ModelSpec
from specedge.runtime.backends.base import Backend, import_optional
from specedge.runtime.cache import CacheTracker
from specedge.runtime.drafters.base import Drafter, Proposal
from specedge.runtime.drafters.ngram import NgramDrafter, NgramIndex
from specedge.runtime.rounds import Round, TargetView, speculative_round, target_step
from specedge.runtime.sampling import SamplingParams, make_rng, probs_from_logits
from specedge.runtime.text import TextStreamer
from specedge.runtime.verify import accept_greedy, verify_greedy, verify_sampling


class Table(Backend):
    """Logits that depend on the last token and the position only."""

    name = "table"

    def __init__(self, vocab=11, max_seq=40, seed=0):
        super().__init__(
            SimpleNamespace(max_seq=max_seq, kv_mode="scatter"), SimpleNamespace(vocab_size=vocab, precision="fp32")
        )
        self.table = np.random.default_rng(seed).normal(size=(vocab, max_seq, vocab)).astype(np.float32)
        self.copies = []

    def run(self, input_ids, position):
        ids = self.check_call(input_ids, position)
        return np.stack([self.table[t, position + j] for j, t in enumerate(ids)])

    def copy_kv_from(self, other, start, end):
        self.copies.append((start, end))
        return isinstance(other, Table)


# ----------------------------------------------------------------------------- proposals / verify


def test_no_probabilities_is_exactly_a_point_mass():
    """verify_sampling without q rows decides exactly as with one-hot rows: the same tokens from
    the same random stream, for accepted and rejected drafts alike."""
    rng = np.random.default_rng(3)
    V = 7
    for trial in range(300):
        k = int(rng.integers(1, 5))
        p = rng.dirichlet(np.full(V, 0.3), size=k + 1)
        if trial % 5 == 0:
            p[0] = np.eye(V)[int(rng.integers(V))]  # a certain target row
        draft = rng.integers(0, V, k).tolist()
        seed = int(rng.integers(1 << 30))
        a = verify_sampling(draft, None, p, make_rng(seed))
        b = verify_sampling(draft, NgramIndex.probs(draft, V), p, make_rng(seed))
        assert a == b


def test_point_mass_rejection_never_emits_the_rejected_token():
    p = np.array([[0.3, 0.7, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    rng = make_rng(0)
    outs = [verify_sampling([1], None, p, rng) for _ in range(3000)]
    firsts = [o[0] for o in outs]
    assert set(firsts) == {0, 1}
    # accepted with probability p(1) = 0.7; a rejection resamples p without token 1: always 0
    assert abs(firsts.count(1) / len(firsts) - 0.7) < 0.03
    assert all(len(o) == 2 for o in outs if o[0] == 1) and all(len(o) == 1 for o in outs if o[0] == 0)


def test_verify_sampling_still_checks_given_rows():
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match=r"draft_probs must be \[k, V\] = \(1, 3\)"):
        verify_sampling([0], np.ones((2, 3)), p, make_rng(0))


def test_accept_greedy_is_verify_greedy_on_the_argmax_rows():
    rng = np.random.default_rng(0)
    for _ in range(100):
        k = int(rng.integers(1, 6))
        logits = rng.normal(size=(k + 1, 5))
        draft = rng.integers(0, 5, k).tolist()
        if rng.random() < 0.5:
            draft = logits.argmax(-1)[:k].tolist()
        assert accept_greedy(draft, logits.argmax(-1)) == verify_greedy(draft, logits)
    with pytest.raises(ValueError, match=r"need len\(draft_tokens\) \+ 1 = 3 argmax rows, got 2"):
        accept_greedy([1, 2], [1, 2])


def test_proposal_is_a_tokens_probs_pair():
    tokens, probs = Proposal([3, 4])
    assert tokens == [3, 4] and probs is None
    assert Proposal(*([1], None)).tokens == [1]


def test_ngram_proposer_proposes_without_probabilities_even_when_sampling():
    d = NgramDrafter(vocab=10)
    assert isinstance(d, Drafter) and d.kind == "ngram" and d.calls == 0 and d.copied == 0
    history = [1, 2, 3, 4, 1, 2]
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=1)):
        prop = d.propose(history, 3, params, make_rng(0))
        assert prop == Proposal([3, 4, 1], None)
    # never an id the target may not emit: the proposal stops before it
    assert NgramDrafter(vocab=4).propose([1, 2, 3, 9, 1, 2], 3, SamplingParams()).tokens == [3]
    assert d.use_kv_donor(CacheTracker(Table(), 4)) is False


def test_a_drafter_must_implement_propose():
    class Nothing(Drafter):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Nothing()


# ----------------------------------------------------------------------------- cache state


def test_cache_tracker_adopt_is_never_exact():
    c = CacheTracker(Table(), 4)
    c.feed_chunked([1, 2, 3, 4, 5])
    assert (c.position, c.exact) == (5, 4)
    c.adopt([6, 7])
    assert c.tokens == [1, 2, 3, 4, 5, 6, 7] and c.exact == 4
    assert c.reuse([1, 2, 3, 4, 5, 6, 7, 8]) == 4  # only the aligned prefill chunk is reused


def test_take_kv_copies_what_the_donor_holds_for_this_history():
    target, draft = CacheTracker(Table(), 4), CacheTracker(Table(seed=1), 4)
    target.feed_chunked([5, 6, 7, 8, 9])
    history = [5, 6, 7, 8, 9, 1]
    assert draft.take_kv(target, history) == 5
    assert draft.tokens == [5, 6, 7, 8, 9] and draft.backend.copies == [(0, 5)]
    assert draft.take_kv(target, history) == 0  # nothing more to take
    other = CacheTracker(Table(), 4)
    other.feed_chunked([5, 6, 2])
    fresh = CacheTracker(Table(seed=2), 4)
    assert fresh.take_kv(other, history) == 2  # only the prefix the donor shares with the history

    class NoCopy(Table):
        def copy_kv_from(self, other, start, end):
            return False

    assert CacheTracker(NoCopy(), 4).take_kv(target, history) == 0


# ----------------------------------------------------------------------------- one round


def test_speculative_round_returns_what_it_did():
    V = 11
    view = TargetView(CacheTracker(Table(V), 4), V, True)
    prompt = [1, 2, 3]
    view.cache.feed_chunked(prompt[:-1])
    ref = Table(V)
    greedy = []
    tok = prompt[-1]
    for j in range(3):
        tok = int(np.argmax(ref.table[tok, 2 + j]))
        greedy.append(tok)

    class Fixed(Drafter):
        kind = "fixed"

        def propose(self, history, k, params, rng=None):
            return Proposal(greedy[:k])

    r = speculative_round(view, Fixed(), prompt, 3, SamplingParams(), None)
    assert isinstance(r, Round) and r.tokens[:3] == greedy and len(r.tokens) == 4
    assert (r.drafted, r.accepted, r.k) == (3, 3, 3) and r.draft_s >= 0 and r.verify_s > 0
    assert view.cache.position == 2 + 4

    class Empty(Drafter):
        def propose(self, history, k, params, rng=None):
            return Proposal([])

    tokens = prompt + r.tokens
    plain = speculative_round(view, Empty(), tokens, 2, SamplingParams(), None)
    assert plain.drafted == 0 and plain.accepted == 0 and plain.k == 2
    assert plain.tokens == [int(np.argmax(ref.table[tokens[-1], len(tokens) - 1]))]
    assert view.cache.position == len(tokens)
    step = target_step(view, tokens + plain.tokens, SamplingParams(), None)
    assert (step.drafted, step.k) == (0, 0) and step.tokens == [int(np.argmax(ref.table[plain.tokens[0], len(tokens)]))]


def test_sampled_round_uses_the_drafts_rows():
    V = 6
    view = TargetView(CacheTracker(Table(V), 4), V, False)
    view.cache.feed_chunked([1, 2])
    params = SamplingParams(temperature=1.0, seed=5)

    q = np.full((1, V), 0.5 / (V - 1))
    q[0, 4] = 0.5

    class Sampled(Drafter):
        def propose(self, history, k, params_, rng=None):
            return Proposal([4], q)

    ref = Table(V).table
    p = probs_from_logits(np.stack([ref[3, 2], ref[4, 3]]), params)
    for seed in range(20):
        view.cache.rollback(2)
        r = speculative_round(view, Sampled(), [1, 2, 3], 1, params, make_rng(seed))
        assert r.drafted == 1 and r.tokens == verify_sampling([4], q, p, make_rng(seed))


# ----------------------------------------------------------------------------- text


def test_text_streamer_holds_back_a_possible_stop_string():
    pieces = {1: "he", 2: "llo", 3: " wo", 4: "rld", 5: "!"}
    t = TextStreamer(lambda ids: "".join(pieces[i] for i in ids), ["world"])
    assert not t.push(1) and t.release() == "he"
    assert not t.push(2) and t.release() == "llo"
    assert not t.push(3) and t.release() == " "  # " wo" may become " world"
    assert t.push(4) and t.text == "hello " and t.release() == ""
    assert not t.finish() and t.rest() == ""


def test_text_streamer_finds_a_stop_string_completed_by_the_flush():
    t = TextStreamer(lambda ids: "".join("ab"[i] for i in ids), ["ba"])
    t.push(1)
    assert t.release() == ""  # "b" may start "ba"
    assert not t.finish() and t.rest() == "b"
    assert TextStreamer(str).finish() is False


# ----------------------------------------------------------------------------- backends, contract


def test_backend_base_refuses_an_ngram_spec_and_bad_calls():
    m = SimpleNamespace(max_seq=8, kv_mode="scatter")
    with pytest.raises(BackendError, match="the draft is an n-gram drafter: it has no graph to run on backend 'table'"):
        Backend.__init__(Table.__new__(Table), m, ModelSpec(role="draft", kind="ngram"))
    b = Table(max_seq=8)
    with pytest.raises(ValueError, match="input_ids must hold at least one token"):
        b.run([], 0)
    with pytest.raises(ValueError, match="3 tokens at position 6 do not fit max_seq 8"):
        b.run([1, 2, 3], 6)
    with pytest.raises(ValueError, match="4 draft steps at position 5 do not fit max_seq 8"):
        b.draft_greedy(1, 5, 4)
    assert not b.has_draft_chain and b.draft_greedy(1, 0, 0).shape == (0,)
    toks, tok = [], 3
    for j in range(3):
        tok = int(np.argmax(b.table[tok, 2 + j]))
        toks.append(tok)
    assert b.draft_greedy(3, 2, 3).tolist() == toks


def test_graphs_off_says_why():
    b = Table()
    b.cuda_graphs = True
    b.graphs_off("CUDA graph capture for T=5", RuntimeError("out of memory\nmore"))
    assert (
        not b.cuda_graphs
        and b.graph_note == "CUDA graph capture for T=5 failed (out of memory); running without graphs"
    )


def test_import_optional_names_what_needs_the_package():
    assert import_optional("json", "x", "y").dumps([1]) == "[1]"
    with pytest.raises(BackendError, match=r"^backend 'x' needs the zz package: pip install zz$"):
        import_optional("specedge_no_such_module", "backend 'x'", "the zz package: pip install zz")


def test_contract_names_and_bounds():
    spec = ModelSpec(
        role="target", kind="model", num_layers=2, num_kv_heads=1, head_dim=4, vocab_size=9, kv_dtype="float32"
    )
    ins, outs = expected_names(spec, "delta", 16)
    assert ins == ["input_ids", "position", "past_key.0", "past_value.0", "past_key.1", "past_value.1"]
    assert outs == ["logits", "new_key.0", "new_value.0", "new_key.1", "new_value.1"]
    assert [parse_kv_name(n) for n in ("new_value.1", "logits", ARGMAX_OUTPUT)] == [("new", 1, 1), None, None]
    assert reserved_call_size(8) == 2 * (MAX_SPEC_TOKENS + 1) and reserved_call_size(64) == 64
