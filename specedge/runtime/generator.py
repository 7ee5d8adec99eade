"""The generation loop: prefill, then rounds (propose -> verify -> commit -> roll back) until a
stop rule; streaming and stats around it.

Each part has its own module: the round itself (rounds.py), which drafter proposes
(drafters/), what the caches hold (cache.py), how k is chosen (policy.py), how ids become text
and where stop strings cut it (text.py). This module commits what a round returns and reports.

Invariant of the loop: `tokens` is the committed sequence (prompt + generated); the target's cache
holds all of it but the last token, which is fed at the start of the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .backends import Backend
from .cache import CacheTracker
from .drafters.base import Drafter
from .policy import DEFAULT_DRAFT_STEP, CostModel, SpecController, static_cost_model
from .requests import GenerationConfig, check_prompt
from .rounds import Round, TargetView, speculative_round, target_step
from .sampling import SamplingParams, make_rng
from .text import TextStreamer
from .tree_round import tree_round
from .tree_size import tree_nodes
from .verify import AcceptanceStats

__all__ = ["Generator", "GenerationConfig", "Result", "FINISH_REASONS"]

FINISH_REASONS = ("eos", "stop", "length", "context")
clock = time.perf_counter


# ----------------------------------------------------------------------------- config / result


def tree_refusal(backend) -> str:
    """Why a tree request cannot run on this target backend: a bundle exported without --tree, or
    a backend that runs no tree calls on a bundle whose graph takes them (re-exporting would not help)."""
    graphs = getattr(getattr(backend, "spec", None), "graphs", None) or ()
    if any(getattr(g, "tree", False) for g in graphs):
        return (
            f"tree verification is not available on the {backend.name} backend, although the bundle's target "
            "graph takes trees: use the ort-cpu or torch backend, or leave tree off"
        )
    return "tree verification needs a target graph that takes trees: export the bundle with --tree"


def inexact_tree_refusal(precision: str) -> str:
    """Why a tree request is refused on a target whose single-token steps are padded to stay exact
    (runtime/invariant.py): the same kernels that round a 1-token call differently from a 2-token
    one (ONNX Runtime's attention) also sum a tree node's keys in another order than the chain's
    when masked siblings sit between them, which flips greedy picks at this precision (specedge's
    int4 kernels sum in key order and do not: benchmarks/experiments/trees/tree_exactness.py)."""
    fix = (
        ", or re-export with --int4-kernel specedge (batch-invariant kernels, exact trees)"
        if precision == "int4"
        else ""
    )
    return (
        f"tree verification would not be exact on this {precision} target: ONNX Runtime's attention "
        f"orders a tree node's sums differently from a chain's, enough to change its picks; leave tree off{fix}"
    )


@dataclass
class Result:
    """A finished generation. `token_ids` are the generated ids (no prompt, no EOS; cut after the
    token that completed a stop string); `text` is their decoded text, cut before the stop string.
    `finish_reason` is one of "eos", "stop", "length", "context"."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- the loop


@dataclass
class _Request:
    """One request's running state: what was committed, its text, the policy and the timings."""

    cfg: GenerationConfig
    params: SamplingParams
    rng: object
    ctl: SpecController
    text: TextStreamer
    tokens: list[int]
    out: list[int] = field(default_factory=list)
    acc: AcceptanceStats = field(default_factory=AcceptanceStats)
    finish: str | None = None
    t_draft: float = 0.0
    t_verify: float = 0.0

    def commit(self, new: list[int], eos: set[int]) -> None:
        """Append a step's tokens up to the first stop rule (EOS, a stop string, the length)."""
        for tok in new:
            if tok in eos:
                self.finish = "eos"
                return
            self.out.append(tok)
            if self.text.push(tok):
                self.finish = "stop"
                return
            if len(self.out) >= self.cfg.max_new_tokens:
                self.finish = "length"
                return

    def record(self, r: Round, speculative: bool) -> None:
        self.t_draft += r.draft_s
        self.t_verify += r.verify_s
        if r.drafted:
            self.acc.record(r.drafted, r.accepted)
            self.ctl.record_round(
                r.k,
                r.accepted,
                r.draft_s,
                r.verify_s,
                r.drafted,
                call=r.call_size,
                depth=r.draft_depth,
                chain_accepted=r.chain_accepted,
            )
        elif speculative:
            self.ctl.record_plain(1, r.verify_s)


def int4_kernels(target, drafter) -> dict:
    """{"target"|"draft": "<kernel> (<why>)"} for the int4 models, from the graphs their backends
    chose at load (runtime/int4_kernel.py)."""
    out = {}
    for role, backend in (("target", target), ("draft", getattr(drafter, "backend", None))):
        choice = getattr(backend, "kernel_choice", None)
        if choice is not None and choice.kernel:
            out[role] = choice.describe()
    return out


class Generator:
    """Runs requests on a target backend and an optional drafter (see drafters/base.py).

    vocab: ids that may be generated (the tokenizer's; logits may have padding rows beyond).
    costs: the pipeline's CostModel (shared across requests; updated while generating).
    static_costs: the fixed costs a seeded sampling run decides with (policy.static_costs).
    invariant_steps: pad the target's single-token steps (runtime/cache.py, runtime/invariant.py).
    """

    def __init__(
        self,
        target: Backend,
        drafter: Drafter | None,
        *,
        vocab: int,
        eos_ids: Sequence[int],
        prefill_chunk: int,
        max_seq: int,
        spec_tokens: int,
        decode: Callable[[list[int]], str],
        costs: CostModel | None = None,
        static_costs: CostModel | None = None,
        invariant_steps: bool = False,
    ):
        self.target = CacheTracker(target, prefill_chunk, invariant_steps)
        self.drafter = drafter
        self.int4_kernels = int4_kernels(target, drafter)
        self.vocab = int(vocab)
        # greedy decoding may use the backend's argmax (on the device for GPU backends) when no
        # padding rows beyond the usable vocabulary could win it
        self.view = TargetView(self.target, self.vocab, self.vocab == target.vocab_size)
        self.eos = set(int(e) for e in eos_ids)
        self.max_seq = int(max_seq)
        self.spec_tokens = int(spec_tokens)
        self.decode = decode
        self.costs = costs or CostModel()
        # fixed, so the same seed gives the same output whatever the machine's timing noise
        self.static_costs = static_costs or static_cost_model(DEFAULT_DRAFT_STEP)

    def reset(self) -> None:
        """Forget every cache's content (after a warm-up or calibration wrote into them)."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def check_tree(self, cfg: GenerationConfig) -> None:
        """Refuse a tree request this target cannot serve (a graph without tree calls) or not
        serve exactly (padded steps: kernels whose sums depend on the call's shape)."""
        if not isinstance(cfg.tree, bool):
            raise ValueError(f"tree must be True or False, got {cfg.tree!r}")
        if cfg.tree and cfg.speculative and self.drafter is not None:
            backend = self.target.backend
            if not backend.takes_trees:
                raise ValueError(tree_refusal(backend))
            if self.target.invariant_steps:
                raise ValueError(inexact_tree_refusal(backend.spec.precision))

    def _request(self, prompt: list[int], cfg: GenerationConfig) -> _Request:
        params = cfg.sampling
        deterministic = not params.greedy and params.seed is not None
        costs = self.static_costs.copy() if deterministic else self.costs
        k = int(cfg.spec_tokens or self.spec_tokens)
        ctl = SpecController(
            k, costs, adaptive=cfg.adaptive_k, guard=cfg.guard, learn=not deterministic, trees=cfg.tree
        )
        return _Request(
            cfg, params, make_rng(params.seed), ctl, TextStreamer(self.decode, cfg.stop or ()), list(prompt)
        )

    def _step(self, req: _Request, speculative: bool) -> Round:
        """The next round: k limited by what is left to generate and by the context."""
        room = self.max_seq - self.target.position  # free slots, >= 1 here
        k = min(req.ctl.next_k() if speculative else 0, req.cfg.max_new_tokens - len(req.out) - 1, room - 1)
        if k < 1:
            return target_step(self.view, req.tokens, req.params, req.rng)
        if req.cfg.tree and req.ctl.use_tree:
            nodes = min(tree_nodes(req.ctl.costs, k), room, self.target.backend.max_call_tokens)
            # a tree may go past k where its drafter's depth is free, within what is left to emit
            depth = min(nodes - 1, req.cfg.max_new_tokens - len(req.out) - 1, room - 1)
            return tree_round(self.view, self.drafter, req.tokens, k, nodes, req.params, req.rng, depth)
        return speculative_round(self.view, self.drafter, req.tokens, k, req.params, req.rng)

    def run(self, prompt: Sequence[int], cfg: GenerationConfig) -> Iterator[str]:
        """Generate for `prompt` (token ids): yields text pieces; the generator's return value
        (StopIteration.value) is the Result."""
        cfg.validate()
        prompt = check_prompt(prompt, self.max_seq)
        req = self._request(prompt, cfg)
        speculative = bool(cfg.speculative and self.drafter is not None)
        self.check_tree(cfg)

        t_start = clock()
        reused = self.target.reuse(prompt)
        first = self.view.first_token(self.target.feed_chunked(prompt[reused:]), req.params, req.rng)
        t_first = clock()
        if speculative:
            self.drafter.start(prompt)
            calls0, copied0 = self.drafter.calls, self.drafter.copied
        req.tokens.append(first)
        new, paused = [first], 0.0
        while True:
            req.commit(new, self.eos)
            if req.finish is None and self.target.position >= self.max_seq:
                req.finish = "context"
            if req.finish is not None:
                break
            piece = req.text.release()
            if piece:
                y0 = clock()
                yield piece
                paused += clock() - y0  # the consumer's time is not ours
            r = self._step(req, speculative)
            req.record(r, speculative)
            new = r.tokens
            req.tokens.extend(new)

        if req.text.finish():
            req.finish = "stop"
        # The target cache must hold only committed tokens for the next request's prefix reuse.
        self.target.rollback(min(self.target.position, len(req.tokens) - 1))
        t_end = clock() - paused
        piece = req.text.rest()
        if piece:
            yield piece
        stats = self._stats(req, prompt, reused, speculative, t_start, t_first, t_end)
        if speculative:
            stats["draft_calls"] = self.drafter.calls - calls0
            # draft cache slots taken from the target's K/V instead of fed (self-draft hand-over)
            stats["draft_kv_copied"] = self.drafter.copied - copied0
        return Result(text=req.text.text, token_ids=req.out, finish_reason=req.finish, stats=stats)

    def _stats(
        self, req: _Request, prompt, reused: int, speculative: bool, t_start: float, t_first: float, t_end: float
    ) -> dict:
        n, acc = len(req.out), req.acc
        decode_s = t_end - t_first
        stats = {
            "tokens": n,
            "prompt_tokens": len(prompt),
            "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "e2e_tokens_per_s": n / (t_end - t_start) if t_end > t_start else 0.0,
            "ttft_s": t_first - t_start,
            "prefill_s": t_first - t_start,
            "decode_s": decode_s,
            "total_s": t_end - t_start,
            "time_draft_s": req.t_draft,
            "time_verify_s": req.t_verify,
            "time_other_s": max(decode_s - req.t_draft - req.t_verify, 0.0),
            "speculative": speculative,
            "drafter": self.drafter.kind if speculative else None,
            "acceptance_rate": acc.acceptance_rate,
            "mean_accepted": acc.mean_accepted,
            "accepted_histogram": acc.histogram,
            "target_calls": acc.calls,
            "drafted": acc.drafted,
            "accepted": acc.accepted,
            "prefix_reused_tokens": reused,
            **({"int4_kernels": self.int4_kernels} if self.int4_kernels else {}),
        }
        if speculative:
            stats.update(req.ctl.to_dict())
        else:
            stats.update({"k": 0, "k_final": 0, "fallbacks": 0})
        return stats
