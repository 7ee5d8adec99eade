"""Public Python API: load a bundle, generate (or stream) text faster than the target alone.

    from specedge.runtime.api import load

    pipe = load("bundles/smollm2-135m-instruct", threads=2)
    result = pipe.generate("def fibonacci(n):", max_new_tokens=64)
    print(result.text, result.finish_reason, result.stats["tokens_per_s"])

    for piece in pipe.stream(messages=[{"role": "user", "content": "Hi!"}]):
        print(piece, end="", flush=True)

Greedy decoding (temperature 0, the default) gives exactly the target's own greedy output, token
for token; sampling gives exactly the target's distribution (speculative sampling), reproducible
with a seed. This module needs numpy, onnxruntime, tokenizers and jinja2 only (no torch).
"""

from __future__ import annotations

import os
import statistics
import time
import weakref
from collections.abc import Sequence

import numpy as np

from ..bundle_files import check_graph_files
from ..manifest import Manifest, check_fits_memory, load_manifest
from .backends import BackendError, SessionOptions, backend_class, resolve_backend_name
from .drafters import check_draft_name, drafter_class
from .generator import GenerationConfig, Generator, Result
from .invariant import choose_invariant_steps
from .ort_version import bundle_opset, check_onnxruntime_version
from .policy import LOOKUP_DRAFT_STEP, CostModel, static_cost_model
from .requests import MAX_THREADS, check_draft_kv, check_load_options, check_prompt, check_text
from .stream import PipelineBusyError, PipelineClosedError, RequestLock, TextStream
from .tokenizer import Tokenizer

__all__ = [
    "load",
    "Pipeline",
    "PipelineBusyError",
    "PipelineClosedError",
    "Tokenizer",
    "TextStream",
    "Result",
    "GenerationConfig",
    "MAX_THREADS",
]

VERIFY_STEPS = {"full": "checking files (sha256)", "size": "checking file sizes", "none": "reading the manifest"}


# ----------------------------------------------------------------------------- pipeline


class Pipeline:
    """A loaded bundle: tokenizer, target backend, drafter. Use `load()` to make one.

    Thread safety: a pipeline runs one request at a time (it has one KV cache). `generate`,
    `stream` and `calibrate` called from several threads take turns: each waits until the one
    before it is done. An open `stream` holds the pipeline until it is exhausted or closed, so a
    thread that opens a stream and then calls `generate`, `stream`, `calibrate` or `close` on the
    same pipeline before finishing it gets a `PipelineBusyError` (waiting would deadlock it). For
    requests that run at the same time, load one pipeline per concurrent request.
    """

    def __init__(
        self,
        manifest: Manifest,
        tokenizer: Tokenizer,
        target,
        drafter,
        backend_name: str,
        draft_backend_name: str | None,
        draft_backend=None,
        draft_kv: str = "auto",
        invariant_steps: bool = False,
    ):
        check_draft_kv(draft_kv)
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.target = target
        self.draft_backend = draft_backend
        self.drafter = drafter
        self.backend_name = backend_name
        self.draft_backend_name = draft_backend_name
        vocab = min(manifest.tokenizer_vocab_size, target.vocab_size)
        if draft_backend is not None and drafter.bounds_vocab:
            vocab = min(vocab, draft_backend.vocab_size)
        self.vocab = vocab
        self.costs = CostModel()
        self._requests = RequestLock()
        self._closed = False
        self._open_stream = None  # weakref to the stream holding the pipeline, if any
        self.generator = Generator(
            target,
            drafter,
            vocab=vocab,
            eos_ids=manifest.eos_token_ids,
            prefill_chunk=manifest.prefill_chunk,
            max_seq=manifest.max_seq,
            spec_tokens=manifest.spec_tokens,
            decode=tokenizer.decode,
            costs=self.costs,
            static_costs=static_cost_model(drafter.step_cost(manifest) if drafter is not None else LOOKUP_DRAFT_STEP),
            invariant_steps=invariant_steps,
        )
        # a self-draft takes the target's K/V for tokens the target has run (Drafter.use_kv_donor):
        # no draft prefill of the prompt; backends that cannot copy (GPU ones) feed as before
        if draft_kv == "auto" and drafter is not None and manifest.draft.extra.get("self_draft_of") == "target":
            drafter.use_kv_donor(self.generator.target)
        if drafter is not None:
            drafter.follow_target(self.generator.target)

    @property
    def max_seq(self) -> int:
        return self.manifest.max_seq

    # -- set-up ------------------------------------------------------------------------------

    def calibrate(self, repeats: int = 3) -> dict:
        """Warm up every call shape the loop uses and measure its cost (median of `repeats`):
        target T = 1 .. k+1, draft T=1. Seeds the speculation guard's cost model. Leaves the
        caches empty."""
        self._begin("calibrate()")
        try:
            return self._calibrate(repeats)
        finally:
            self._requests.release()

    def _calibrate(self, repeats: int) -> dict:
        k = self.manifest.spec_tokens

        def timeit(backend, t):  # a backend, or the target's cache tracker (padded steps)
            ids = np.zeros(t, dtype=np.int64)
            backend.run(ids, 0)  # first call of a shape: allocation planning
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                backend.run(ids, 0)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        out = {}
        target = self.generator.target
        self.costs.target[1] = out["target_1"] = timeit(target, 1)
        if self.drafter is not None:
            # every verification size, each timed after its warm-up call: a short n-gram match feeds
            # T < k + 1, and a size first timed cold (allocation planning) misleads the guard for long
            for t in range(2, k + 2):
                self.costs.target[t] = out[f"target_{t}"] = timeit(target, t)
        if self.draft_backend is not None:
            out["draft_1"] = timeit(self.draft_backend, 1)
            self.draft_backend.run(np.zeros(2, dtype=np.int64), 0)  # the catch-up shape
            self.costs.draft = out["draft_1"]
        elif self.drafter is not None:
            self.costs.draft = 2e-5  # n-gram lookup: tens of microseconds
        self.generator.reset()
        return out

    def _begin(self, what: str) -> None:
        """Take the pipeline for a request, or refuse one on a closed pipeline."""
        self._requests.acquire(what)
        if self._closed:
            self._requests.release()
            raise PipelineClosedError(
                f"the pipeline is closed: close() freed its sessions, so {what.split('(')[0]} "
                "cannot run (load() the bundle again)"
            )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def busy(self) -> bool:
        """True while a request (a `generate` call or an open stream) holds the pipeline."""
        return self._requests.busy

    def close(self) -> None:
        """Free the sessions. A stream this thread still has open is closed first (so leaving a
        `with` block or a `finally` mid-stream works); a request running on another thread is
        waited for."""
        stream = self._open_stream() if self._open_stream is not None else None
        if stream is not None and self._requests.held_here():
            stream.close()
        self._requests.acquire("close()")
        try:
            if self._closed:
                return
            self._closed = True
            for b in (self.target, self.draft_backend):
                if b is not None:
                    b.close()
        finally:
            self._requests.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self) -> dict:
        d = {
            "bundle": str(self.manifest.root),
            "max_seq": self.manifest.max_seq,
            "kv_mode": self.manifest.kv_mode,
            "spec_tokens": self.manifest.spec_tokens,
            "target": self.target.describe(),
            "drafter": self.drafter.kind if self.drafter is not None else None,
        }
        if self.generator.target.invariant_steps:
            d["target"]["invariant_steps"] = True
        if self.draft_backend is not None:
            d["draft"] = self.draft_backend.describe()
        return d

    # -- requests ----------------------------------------------------------------------------

    def encode(
        self, prompt: str | None = None, messages: Sequence[dict] | None = None, token_ids: Sequence[int] | None = None
    ) -> list[int]:
        """The prompt's token ids from exactly one of: plain text, chat messages, token ids."""
        given = [x is not None for x in (prompt, messages, token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("the prompt is empty")
            check_text(prompt, "the prompt")
            ids = self.tokenizer.encode(prompt)
        elif messages is not None:
            ids = self.tokenizer.encode_chat(messages)
        else:
            ids = [int(t) for t in token_ids]
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise ValueError(f"token ids must be in [0, {self.vocab}){self._lacks(bad)}")
        return check_prompt(ids, self.max_seq)

    def _lacks(self, tok: int) -> str:
        """For a prompt id the model cannot embed: what it is when the tokenizer has it. A
        tokenizer may hold added tokens past the model's embedding rows (a checkpoint whose
        tokenizer grew), which text can name; refused here, not inside the graph's Gather."""
        name = self.tokenizer.tok.id_to_token(tok) if 0 <= tok < self.tokenizer.vocab_size else None
        return (
            ""
            if name is None
            else f": the prompt holds token {tok} ('{name}'), which the tokenizer has but the model does not"
        )

    def stream(
        self,
        prompt: str | None = None,
        messages: Sequence[dict] | None = None,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        spec_tokens: int | None = None,
        speculative: bool = True,
        adaptive_k: bool = False,
        guard: bool = True,
        tree: bool = False,
    ) -> TextStream:
        """Like `generate`, but returns a TextStream yielding text pieces as tokens are accepted;
        its `result` attribute holds the Result once the stream is exhausted. Arguments are checked
        before the first piece is requested. The stream holds the pipeline from this call until it
        is exhausted or closed (see the class docstring)."""
        cfg = GenerationConfig(
            max_new_tokens, temperature, top_k, top_p, seed, stop, spec_tokens, speculative, adaptive_k, guard, tree
        ).validate()
        self.generator.check_tree(cfg)
        ids = self.encode(prompt, messages, token_ids)
        self._begin("stream()")
        stream = TextStream(self.generator.run(ids, cfg), self._requests.release)
        self._open_stream = weakref.ref(stream)
        return stream

    def generate(
        self,
        prompt: str | None = None,
        messages: Sequence[dict] | None = None,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        spec_tokens: int | None = None,
        speculative: bool = True,
        adaptive_k: bool = False,
        guard: bool = True,
        tree: bool = False,
    ) -> Result:
        """Generate a completion.

        prompt / messages / token_ids: exactly one (plain text gets BOS if the bundle says so;
          messages go through the chat template with the generation prompt).
        max_new_tokens: >= 1. temperature: 0 = greedy (default); top_k (0 = off), top_p in (0, 1].
        seed: sampling seed (None = fresh entropy). stop: strings that end the text (cut before).
        spec_tokens: k, draft tokens per round (1..16; default the bundle's). speculative=False
          decodes with the target alone. adaptive_k: move k with acceptance (off by default).
        guard: shrink k / fall back to target-only when speculation stops paying (default on).
        tree: verify a tree of drafts per target call (a bundle exported with --tree, a drafter
          with `propose_tree`; docs/design.md "Tree calls").

        Returns Result(text, token_ids, finish_reason in {"eos", "stop", "length", "context"},
        stats) — stats: tokens, tokens_per_s (decode), ttft_s, acceptance_rate, mean_accepted
        (tokens per target call), accepted_histogram, time_draft_s / time_verify_s /
        time_other_s, k, k_final, fallbacks, ...

        Calls from several threads take turns; a call from a thread whose own stream on this
        pipeline is still open raises PipelineBusyError.
        """
        s = self.stream(
            prompt,
            messages,
            token_ids,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            stop,
            spec_tokens,
            speculative,
            adaptive_k,
            guard,
            tree,
        )
        with s:
            for _ in s:
                pass
        return s.result


def load(
    bundle: str | os.PathLike,
    backend: str = "auto",
    draft_backend: str | None = None,
    threads: int | None = None,
    providers=None,
    draft: str | None = None,
    verify: str = "full",
    warmup: bool = True,
    spinning: bool | None = None,
    shared_pool: bool = False,
    draft_kv: str = "auto",
    backend_options: dict | None = None,
    progress=None,
    invariant_steps: bool | None = None,
    int4_kernel: str = "auto",
) -> Pipeline:
    """Load a bundle and return a Pipeline.

    backend: "auto" (ort-cuda when onnxruntime-gpu's CUDA provider is usable, else ort-cpu),
      "ort-cpu", "ort-cuda", "ort-trt", "tensorrt" or "torch". draft_backend: the draft's
      (default: the same). threads: intra-op threads per ONNX Runtime session. providers: ONNX
      Runtime execution providers (names or (name, options) pairs) for ort-* backends.
    draft: "model" (the bundle's draft model), "ngram" (prompt lookup, no model), "head" (the
      bundle's trained draft head, `specedge train-draft`; it runs on ort-cpu, beside a target on
      any backend) or None (the bundle's own kind).
    verify: bundle file check, "full" (sha256), "size" or "none".
    warmup: run each call shape once and measure step costs (`Pipeline.calibrate`).
    spinning: ONNX Runtime intra-op spinning; None = off whenever a draft session exists (two
      spinning pools on a small CPU slow each other down), on otherwise.
    shared_pool: run every ONNX Runtime CPU session on one process-wide spinning pool of `threads`
      threads, so the target and draft take turns on the same hot threads (the CLI does). Once
      made, onnxruntime's Python binding runs every session of the process on it: other thread
      counts or spinning off are refused, and sessions the host application makes itself must not
      ask for pools of their own.
    draft_kv: "auto" (a self-draft copies the target's K/V for the tokens the target has already
      run instead of computing its own: no draft prefill of the prompt, where ONNX Runtime CPU
      backends serve both) or "own" (the draft feeds every token itself).
    progress: called with the name of each loading step (for a progress display).
    invariant_steps: run the target's single-token steps as two-token calls, so that they round
      exactly like verification rows and greedy speculation equals target-only decoding bit for
      bit (runtime/invariant.py); None = on for int4/int8/fp16/bf16 targets, off for fp32 and
      for a target graph marked batch-invariant whose rows this machine confirms (one T = 1 and
      one T = 2 call at load).
    int4_kernel: which graph an int4 model with two runs on ort-cpu (runtime/int4_kernel.py):
      "auto" (specedge's kernels where they have a fast path here, else ONNX Runtime's
      MatMulNBits, with one note), "specedge" or "matmulnbits"; `describe()` and the stats say
      which ran and why.
    """
    say = progress or (lambda step: None)
    check_load_options(
        verify=verify, threads=threads, draft_kv=draft_kv, invariant_steps=invariant_steps, int4_kernel=int4_kernel
    )
    check_draft_name(draft)
    say(VERIFY_STEPS[verify])
    manifest = load_manifest(bundle, verify=verify)
    drafter_kind = drafter_class(draft, manifest)
    # where the graphs make ONNX Runtime read weights from, whatever `verify` says
    check_graph_files(manifest)
    tokenizer = Tokenizer(manifest)
    tname = resolve_backend_name(backend)
    dname = drafter_kind.backend_name(tname, draft_backend)
    _check_backends(manifest, tname, dname, providers)
    session = SessionOptions(
        threads=threads,
        providers=providers,
        allow_spinning=spinning,
        alternating=dname is not None,
        shared_pool=shared_pool,
        int4_kernel=int4_kernel,
    )
    say(f"target session ({tname})")
    target = backend_class(tname).open(manifest, manifest.target, session, backend_options)
    if invariant_steps is None:
        invariant_steps = choose_invariant_steps(manifest, tname, target)
    dbackend = None
    try:
        if dname is not None:
            say(f"{drafter_kind.session_label} ({dname})")
            dbackend = drafter_kind.open_backend(dname, manifest, session, backend_options, tname)
        vocab = min(manifest.tokenizer_vocab_size, manifest.target.vocab_size)
        drafter = drafter_kind.from_bundle(manifest, dbackend, vocab)
        pipe = Pipeline(
            manifest,
            tokenizer,
            target,
            drafter,
            tname,
            dname,
            dbackend,
            draft_kv=draft_kv,
            invariant_steps=invariant_steps,
        )
        if warmup:
            say("warm-up")
            pipe.calibrate()
    except BaseException:
        target.close()
        if dbackend is not None:
            dbackend.close()
        raise
    return pipe


def _check_backends(manifest: Manifest, tname: str, dname: str | None, providers) -> None:
    """What the chosen backends need of this machine and of the arguments, before any session."""
    if any(n and n.startswith("ort-") for n in (tname, dname)):
        try:
            import onnxruntime
        except ImportError:
            pass  # the backend says how to install it
        else:
            check_onnxruntime_version(onnxruntime.__version__, bundle_opset(manifest))
    if tname == "ort-cpu":  # the KV caches and logits live in host memory
        check_fits_memory(manifest, draft=dname is not None)
    if providers is not None and not all(n.startswith("ort-") for n in (tname, dname) if n):
        raise BackendError("providers apply to the ONNX Runtime backends (ort-cpu, ort-cuda, ort-trt) only")
