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

import json
import os
import statistics
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..bundle_files import check_graph_files
from ..manifest import BundleError, Manifest, check_fits_memory, load_manifest
from .backends import BackendError, backend_class, create_backend, resolve_backend_name
from ..contract import MAX_SPEC_TOKENS
from .chat_template import ChatTemplate
from .drafters.head import HeadDrafter, read_draft_vocab
from .drafters.model import ModelDrafter
from .drafters.ngram import NgramProposer
from .generator import GenerationConfig, Generator, Result, check_prompt
from .int4_kernel import CHOICES as INT4_KERNELS
from .invariant import InvariantSteps, rows_independent_of_t, wants_invariant_steps
from .ort_version import bundle_opset, check_onnxruntime_version
from .policy import CostModel

# ONNX Runtime intra-op threads per session: more than any CPU has cores; a larger number is a
# typo that would spawn threads until memory runs out (the C API and both CLIs share the cap).
MAX_THREADS = 1024

__all__ = ["load", "Pipeline", "PipelineBusyError", "PipelineClosedError", "Tokenizer", "TextStream", "Result", "GenerationConfig"]


# ----------------------------------------------------------------------------- tokenizer + template


def _token_string(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """The bundle's tokenizer (HF `tokenizers` format) and chat template (sandboxed jinja2)."""

    def __init__(self, manifest: Manifest):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:  # pragma: no cover - a hard dependency
            raise BundleError("the tokenizers package is needed to read the bundle's tokenizer: pip install tokenizers") from None
        files = {Path(f).name: f for f in manifest.tokenizer_files}
        if "tokenizer.json" not in files:
            raise BundleError("the bundle lists no tokenizer.json")
        path = manifest.path(files["tokenizer.json"])
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise BundleError(f"cannot read the bundle's tokenizer.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self.config: dict = {}
        if "tokenizer_config.json" in files:
            try:
                self.config = json.loads(manifest.path(files["tokenizer_config.json"]).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise BundleError(f"cannot read the bundle's tokenizer_config.json: {e}") from None
            if not isinstance(self.config, dict):
                raise BundleError("the bundle's tokenizer_config.json is not a JSON object")
        self.bos_token_id = manifest.bos_token_id
        self.add_bos = manifest.add_bos
        self.eos_token_ids = list(manifest.eos_token_ids)
        self.special_tokens = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            s = _token_string(self.config.get(name))
            if s is not None:
                self.special_tokens[name] = s
        if "bos_token" not in self.special_tokens and self.bos_token_id is not None:
            s = self.tok.id_to_token(self.bos_token_id)
            if s is not None:
                self.special_tokens["bos_token"] = s
        if "eos_token" not in self.special_tokens:
            s = self.tok.id_to_token(self.eos_token_ids[0])
            if s is not None:
                self.special_tokens["eos_token"] = s
        self.chat_template: str | None = None
        if manifest.chat_template:
            try:
                self.chat_template = manifest.path(manifest.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise BundleError(f"cannot read the bundle's chat template: {e}") from None
        else:
            ct = self.config.get("chat_template")
            if isinstance(ct, list):  # named templates: take the default one
                ct = next((t.get("template") for t in ct if isinstance(t, dict) and t.get("name") == "default"), None)
            self.chat_template = ct if isinstance(ct, str) else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` without the tokenizer's own special tokens; the bundle's BOS is
        prepended when `add_bos` (default: the manifest's add_bos)."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered in a sandbox under limits (templates in bundles are
        untrusted; see chat_template.py). Failures are ValueError (ChatTemplateError) sentences."""
        if not self.chat_template:
            raise ValueError("the bundle has no chat template, so chat messages cannot be formatted")
        _check_messages(messages)
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Rendered template -> ids, without adding special tokens (the template has them)."""
        return self.encode(self.render_chat(messages), add_bos=False)


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message must be a dict with string 'role' and 'content'")
        _check_text(m["role"], "a message's role")
        _check_text(m["content"], "a message's content")


def _check_text(text: str, what: str) -> None:
    """Refuse text that is not encodable Unicode: lone surrogates, which is how Python carries
    bytes that were not UTF-8 (command-line arguments, surrogateescape streams)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text (a lone surrogate at character {e.start}: "
                         "bytes that were not UTF-8)") from None


# ----------------------------------------------------------------------------- streaming


class TextStream:
    """Iterate to get text pieces as tokens are accepted; `result` is set once it is exhausted.

    An open stream holds its pipeline (see `Pipeline`): exhaust it or `close()` it (or use it as
    a context manager) to let the next request run."""

    def __init__(self, gen: Iterator[str], release=None):
        self._gen = gen
        self._release = release
        self.result: Result | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as e:
            self.result = e.value
            self._done()
            raise
        except BaseException:
            self._done()
            raise

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def close(self) -> None:
        try:
            self._gen.close()
        finally:
            self._done()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # an abandoned stream must not keep the pipeline busy forever
        self._done()


class PipelineBusyError(RuntimeError):
    """A request on a pipeline from the thread that already holds it (an open stream)."""


class PipelineClosedError(RuntimeError):
    """A request on a pipeline after its `close()`."""


class _RequestLock:
    """One request at a time per pipeline: other threads wait their turn; the thread that holds
    it (a stream it opened is still open) is refused, since waiting would deadlock it and running
    would corrupt the KV cache the open stream is using."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()  # a plain Lock: a stream may be finished on another thread
        self._owner: int | None = None
        self._ident = threading.get_ident

    def held_here(self) -> bool:
        return self._owner == self._ident()

    def acquire(self, what: str) -> None:
        if self._owner == self._ident():
            raise PipelineBusyError(
                f"the pipeline is busy: {what} was called while a stream this thread opened on it is still open "
                "(exhaust or close() that stream first; use one pipeline per concurrent request)"
            )
        self._lock.acquire()
        self._owner = self._ident()

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    @property
    def busy(self) -> bool:
        return self._lock.locked()


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

    def __init__(self, manifest: Manifest, tokenizer: Tokenizer, target, drafter, backend_name: str,
                 draft_backend_name: str | None, draft_backend=None, draft_kv: str = "auto"):
        if draft_kv not in ("auto", "own"):
            raise ValueError(f"draft_kv must be 'auto' or 'own', got {draft_kv!r}")
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.target = target
        self.draft_backend = draft_backend
        self.drafter = drafter
        self.backend_name = backend_name
        self.draft_backend_name = draft_backend_name
        vocab = min(manifest.tokenizer_vocab_size, target.vocab_size)
        if draft_backend is not None and drafter.kind != "head":  # a head's logits cover its draft vocabulary
            vocab = min(vocab, draft_backend.vocab_size)
        self.vocab = vocab
        self.costs = CostModel()
        self._requests = _RequestLock()
        self._closed = False
        self._open_stream = None  # weakref to the stream holding the pipeline, if any
        self.generator = Generator(
            target, drafter, vocab=vocab, eos_ids=manifest.eos_token_ids, prefill_chunk=manifest.prefill_chunk,
            max_seq=manifest.max_seq, spec_tokens=manifest.spec_tokens, decode=tokenizer.decode, costs=self.costs,
            static_costs=self._static_costs(),
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

    def _static_costs(self) -> CostModel:
        """Fixed costs for seeded sampling (see Generator): decode is memory-bound, so a draft step
        costs about its weight bytes relative to the target's, and verifying k + 1 tokens a little
        more than one."""
        m = self.manifest
        if self.drafter is None or self.drafter.kind == "ngram":
            r = 0.01
        elif (d := m.head if self.drafter.kind == "head" else m.draft).weight_bytes > 0 and m.target.weight_bytes > 0:
            r = max(d.weight_bytes / m.target.weight_bytes, 0.02)
        else:
            r = 0.3
        return CostModel({1: 1.0, MAX_SPEC_TOKENS + 1: 1.0 + 0.05 * MAX_SPEC_TOKENS}, r)

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
        def timeit(backend, t):
            ids = np.zeros(t, dtype=np.int64)
            backend.run(ids, 0)  # first call of a shape: allocation planning
            ts = []
            for _ in range(repeats):
                t0 = _clock()
                backend.run(ids, 0)
                ts.append(_clock() - t0)
            return statistics.median(ts)

        out = {}
        self.costs.target[1] = out["target_1"] = timeit(self.target, 1)
        if self.drafter is not None:
            # every verification size, each timed after its warm-up call: a short n-gram match feeds
            # T < k + 1, and a size first timed cold (allocation planning) misleads the guard for long
            for t in range(2, k + 2):
                self.costs.target[t] = out[f"target_{t}"] = timeit(self.target, t)
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
            raise PipelineClosedError(f"the pipeline is closed: close() freed its sessions, so {what.split('(')[0]} "
                                      "cannot run (load() the bundle again)")

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
        if self.draft_backend is not None:
            d["draft"] = self.draft_backend.describe()
        return d

    # -- requests ----------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               token_ids: Sequence[int] | None = None) -> list[int]:
        """The prompt's token ids from exactly one of: plain text, chat messages, token ids."""
        given = [x is not None for x in (prompt, messages, token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("the prompt is empty")
            _check_text(prompt, "the prompt")
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
        return "" if name is None else f": the prompt holds token {tok} ('{name}'), which the tokenizer has but the model does not"

    def stream(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
               token_ids: Sequence[int] | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | str | None = None,
               spec_tokens: int | None = None, speculative: bool = True, adaptive_k: bool = False,
               guard: bool = True, tree: bool = False) -> TextStream:
        """Like `generate`, but returns a TextStream yielding text pieces as tokens are accepted;
        its `result` attribute holds the Result once the stream is exhausted. Arguments are checked
        before the first piece is requested. The stream holds the pipeline from this call until it
        is exhausted or closed (see the class docstring)."""
        cfg = GenerationConfig(max_new_tokens, temperature, top_k, top_p, seed, stop, spec_tokens, speculative,
                               adaptive_k, guard, tree).validate()
        self.generator.check_tree(cfg)
        ids = self.encode(prompt, messages, token_ids)
        self._begin("stream()")
        stream = TextStream(self.generator.run(ids, cfg), self._requests.release)
        self._open_stream = weakref.ref(stream)
        return stream

    def generate(self, prompt: str | None = None, messages: Sequence[dict] | None = None,
                 token_ids: Sequence[int] | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] | str | None = None,
                 spec_tokens: int | None = None, speculative: bool = True, adaptive_k: bool = False,
                 guard: bool = True, tree: bool = False) -> Result:
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
        s = self.stream(prompt, messages, token_ids, max_new_tokens, temperature, top_k, top_p, seed, stop,
                        spec_tokens, speculative, adaptive_k, guard, tree)
        with s:
            for _ in s:
                pass
        return s.result


def _clock() -> float:
    import time

    return time.perf_counter()


def _check_onnxruntime(manifest: Manifest) -> None:
    try:
        import onnxruntime
    except ImportError:
        return  # the backend says how to install it
    check_onnxruntime_version(onnxruntime.__version__, bundle_opset(manifest))


def _accepts(klass, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(klass.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _batch_invariant(manifest: Manifest, backend_name: str, target) -> bool:
    """A target graph marked batch-invariant, whose single-token rows this machine's kernels
    confirm (invariant.rows_independent_of_t): its steps need no padding to stay exact."""
    try:  # the graph the backend chose (runtime/int4_kernel.py), else the one it serves
        marked = (getattr(target, "graph_spec", None) or manifest.target.graph_for(backend_name)).batch_invariant
    except BundleError:
        return False
    if not marked:
        return False
    if rows_independent_of_t(target):
        return True
    import warnings

    warnings.warn("the target graph is marked batch-invariant, but on this machine a single-token call's row differs "
                  "from a verification row: single-token steps run as 2 tokens to stay exact", RuntimeWarning,
                  stacklevel=3)
    return False


def load(bundle: str | os.PathLike, backend: str = "auto", draft_backend: str | None = None, threads: int | None = None,
         providers=None, draft: str | None = None, verify: str = "full", warmup: bool = True,
         spinning: bool | None = None, shared_pool: bool = False, draft_kv: str = "auto",
         backend_options: dict | None = None, progress=None, invariant_steps: bool | None = None,
         int4_kernel: str = "auto") -> Pipeline:
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
    if verify not in ("full", "size", "none"):
        raise ValueError(f"verify must be full, size or none, got {verify!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise ValueError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
    if draft_kv not in ("auto", "own"):
        raise ValueError(f"draft_kv must be 'auto' or 'own', got {draft_kv!r}")
    if draft not in (None, "model", "ngram", "head"):
        raise ValueError(f"draft must be 'model', 'ngram', 'head' or None, got {draft!r}")
    if invariant_steps is not None and not isinstance(invariant_steps, bool):
        raise ValueError(f"invariant_steps must be True, False or None, got {invariant_steps!r}")
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got {int4_kernel!r}")
    say({"full": "checking files (sha256)", "size": "checking file sizes", "none": "reading the manifest"}[verify])
    manifest = load_manifest(bundle, verify=verify)
    if draft is None:
        draft = "model" if manifest.draft.is_model else "ngram"
    if draft == "model" and not manifest.draft.is_model:
        raise ValueError("this bundle's draft is an n-gram drafter: it has no draft model (use draft='ngram')")
    if draft == "head" and manifest.head is None:
        raise ValueError("this bundle has no draft head: train one with `specedge train-draft BUNDLE`")
    # where the graphs make ONNX Runtime read weights from, whatever `verify` says
    check_graph_files(manifest)
    tokenizer = Tokenizer(manifest)
    tname = resolve_backend_name(backend)
    if draft == "head":
        # the head is a few MB: it runs on the CPU next to any target, which hands it its features
        dname = resolve_backend_name(draft_backend) if draft_backend else "ort-cpu"
        if dname != "ort-cpu":
            raise BackendError(f"a draft head runs on the ort-cpu backend (draft_backend {dname!r}); "
                               "its target may use any backend")
    else:
        dname = resolve_backend_name(draft_backend or backend) if draft == "model" else None
    if any(n and n.startswith("ort-") for n in (tname, dname)):
        _check_onnxruntime(manifest)
    if tname == "ort-cpu":  # the KV caches and logits live in host memory
        check_fits_memory(manifest, draft=dname is not None)
    if providers is not None and not all(n.startswith("ort-") for n in (tname, dname) if n):
        raise BackendError("providers apply to the ONNX Runtime backends (ort-cpu, ort-cuda, ort-trt) only")
    two_sessions = dname is not None

    def make(name, spec, klass=None):
        # a head beside a GPU target runs on the CPU: backend_options are the target backend's
        head_apart = spec.kind == "head" and tname != "ort-cpu"
        opts = {} if head_apart else dict(backend_options or {})
        klass = klass or backend_class(name)
        if _accepts(klass, "allow_spinning"):
            opts["allow_spinning"] = spinning
        if _accepts(klass, "alternating"):
            opts["alternating"] = two_sessions
        if shared_pool and _accepts(klass, "shared_pool"):
            opts["shared_pool"] = True
        if int4_kernel != "auto" and _accepts(klass, "int4_kernel"):
            opts["int4_kernel"] = int4_kernel
        # threads size ONNX Runtime's CPU pools; GPU-only backends have none and ignore it
        t = threads if _accepts(klass, "threads") else None
        if spec.kind == "head":
            return klass(manifest, spec, threads=t, providers=None if head_apart else providers, **opts)
        return create_backend(name, manifest, spec, threads=t, providers=providers, **opts)

    say(f"target session ({tname})")
    target = make(tname, manifest.target)
    if invariant_steps is None:
        invariant_steps = (wants_invariant_steps(manifest.target.precision)
                           and not _batch_invariant(manifest, tname, target))
    if invariant_steps:
        target = InvariantSteps(target)
    dbackend = None
    try:
        vocab = min(manifest.tokenizer_vocab_size, manifest.target.vocab_size)
        if draft == "model":
            say(f"draft session ({dname})")
            dbackend = make(dname, manifest.draft)
            drafter = ModelDrafter(dbackend, manifest.prefill_chunk, vocab=min(vocab, dbackend.vocab_size))
        elif draft == "head":
            say("draft head session (ort-cpu)")
            from .backends.ort_head import OrtHeadBackend

            dbackend = make(dname, manifest.head, OrtHeadBackend)
            drafter = HeadDrafter(dbackend, read_draft_vocab(manifest), vocab, manifest.prefill_chunk)
        else:
            sizes = manifest.draft.extra.get("ngram_sizes", (3, 2, 1)) if manifest.draft.kind == "ngram" else (3, 2, 1)
            drafter = NgramProposer(vocab, ngram_sizes=tuple(sizes))
        pipe = Pipeline(manifest, tokenizer, target, drafter, tname, dname, dbackend, draft_kv=draft_kv)
        if warmup:
            say("warm-up")
            pipe.calibrate()
    except BaseException:
        target.close()
        if dbackend is not None:
            dbackend.close()
        raise
    return pipe

