"""Prometheus metrics of one server (its own registry, so several apps in a process stay apart).

Per task label (the request's `specedge.task`, "default" when absent): requests by outcome,
generated and prompt tokens, decode tokens/s, time to first token, total latency, drafted and
accepted draft tokens and target calls, whence the acceptance rate and mean accepted tokens per
target call (also exported as gauges over the server's lifetime), guard fallbacks, reused prefix
tokens. The speculation counters are also exported under vLLM's `spec_decode` names
(`specedge:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos` with a `position` label), so dashboards built for vLLM (and
llama.cpp, which follows it) read them with the prefix changed. Server-wide: queue wait, queue
depth, busy replicas, errors by kind.

Task labels come from clients, so their number is capped (`max_tasks` distinct labels besides
"default"); later labels are counted under OVERFLOW_TASK, which no request can name.
"""

from __future__ import annotations

import threading

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServeMetrics", "CONTENT_TYPE_LATEST", "DEFAULT_MAX_TASKS", "OVERFLOW_TASK"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATE = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
DEFAULT_MAX_TASKS = 64
OVERFLOW_TASK = "(other)"  # outside the task pattern of schemas.py: a request cannot name it


class TaskLabels:
    """The task labels the metrics use: the first `limit` distinct ones as given (and "default"
    always), every later one as OVERFLOW_TASK."""

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"the task label cap must be >= 0, got {limit}")
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, task: str) -> str:
        if task == "default":
            return task
        with self._lock:
            if task in self._seen:
                return task
            if len(self._seen) < self.limit:
                self._seen.add(task)
                return task
        return OVERFLOW_TASK


class ServeMetrics:
    def __init__(self, max_tasks: int = DEFAULT_MAX_TASKS, model: str = ""):
        self.task_label = TaskLabels(max_tasks)
        self.model = model
        r = self.registry = CollectorRegistry()
        t = ("task",)
        self.requests = Counter(
            "specedge_requests",
            "Requests by endpoint, task and outcome (ok, cancelled, timeout, error)",
            ("endpoint", "task", "outcome"),
            registry=r,
        )
        self.errors = Counter("specedge_errors", "Error answers by kind", ("kind",), registry=r)
        self.generated = Counter("specedge_generated_tokens", "Tokens generated", t, registry=r)
        self.prompt = Counter("specedge_prompt_tokens", "Prompt tokens", t, registry=r)
        self.reused = Counter(
            "specedge_prefix_reused_tokens", "Prompt tokens served from a replica's cache", t, registry=r
        )
        self.drafted = Counter("specedge_drafted_tokens", "Draft tokens proposed", t, registry=r)
        self.accepted = Counter("specedge_accepted_tokens", "Draft tokens accepted", t, registry=r)
        self.target_calls = Counter("specedge_target_calls", "Target calls during decoding", t, registry=r)
        self.fallbacks = Counter(
            "specedge_guard_fallbacks", "Speculation guard fallbacks to target-only", t, registry=r
        )
        self.acceptance = Gauge("specedge_acceptance_rate", "Accepted / drafted tokens since start", t, registry=r)
        self.mean_accepted = Gauge(
            "specedge_mean_accepted_tokens", "Tokens committed per target call since start", t, registry=r
        )
        self.tokens_per_s = Histogram(
            "specedge_tokens_per_second", "Decode tokens/s per request", t, buckets=_RATE, registry=r
        )
        self.ttft = Histogram(
            "specedge_time_to_first_token_seconds",
            "Time to first token (queue wait included)",
            t,
            buckets=_LATENCY,
            registry=r,
        )
        self.latency = Histogram(
            "specedge_request_duration_seconds", "Request time (queue wait included)", t, buckets=_LATENCY, registry=r
        )
        self.queue_wait = Histogram(
            "specedge_queue_wait_seconds", "Time a request waited for a replica", buckets=_LATENCY, registry=r
        )
        self.queue_depth = Gauge("specedge_queue_depth", "Requests waiting for a replica", registry=r)
        self.busy = Gauge("specedge_replicas_busy", "Replicas running a request", registry=r)
        # vLLM's names and meanings (vllm/v1/spec_decode/metrics.py): drafts are verification
        # calls that checked draft tokens; position i counts the drafts whose token i was accepted
        vt = ("model_name", "task")
        self.sd_drafts = Counter("specedge:spec_decode_num_drafts", "Number of spec decoding drafts.", vt, registry=r)
        self.sd_draft_tokens = Counter(
            "specedge:spec_decode_num_draft_tokens", "Number of draft tokens.", vt, registry=r
        )
        self.sd_accepted = Counter(
            "specedge:spec_decode_num_accepted_tokens", "Number of accepted tokens.", vt, registry=r
        )
        self.sd_per_pos = Counter(
            "specedge:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            (*vt, "position"),
            registry=r,
        )
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}  # task -> [drafted, accepted, committed, calls]

    def finished(self, endpoint: str, task: str, stats: dict, queue_wait: float, ttft: float, total: float) -> None:
        """A request that ran to its end (`stats`: the pipeline Result's stats)."""
        task = self.task_label(task)
        self.requests.labels(endpoint, task, "ok").inc()
        self.generated.labels(task).inc(stats["tokens"])
        self.prompt.labels(task).inc(stats["prompt_tokens"])
        self.reused.labels(task).inc(stats.get("prefix_reused_tokens", 0))
        self.fallbacks.labels(task).inc(stats.get("fallbacks", 0))
        self.tokens_per_s.labels(task).observe(stats["tokens_per_s"])
        self.ttft.labels(task).observe(ttft)
        self.latency.labels(task).observe(total)
        if stats.get("speculative"):
            drafted, accepted, calls = stats["drafted"], stats["accepted"], stats["target_calls"]
            self.drafted.labels(task).inc(drafted)
            self.accepted.labels(task).inc(accepted)
            self.target_calls.labels(task).inc(calls)
            self._spec_decode(task, stats)
            with self._lock:
                tot = self._totals.setdefault(task, [0, 0, 0, 0])
                tot[0] += drafted
                tot[1] += accepted
                tot[2] += accepted + calls  # each verification call commits its accepted drafts + one token
                tot[3] += calls
                if tot[0]:
                    self.acceptance.labels(task).set(tot[1] / tot[0])
                if tot[3]:
                    self.mean_accepted.labels(task).set(tot[2] / tot[3])

    def _spec_decode(self, task: str, stats: dict) -> None:
        labels = (self.model, task)
        self.sd_drafts.labels(*labels).inc(stats["target_calls"])
        self.sd_draft_tokens.labels(*labels).inc(stats["drafted"])
        self.sd_accepted.labels(*labels).inc(stats["accepted"])
        hist = stats.get("accepted_histogram") or []  # hist[n]: drafts that accepted exactly n tokens
        reached = sum(hist)
        for pos in range(len(hist) - 1):
            reached -= hist[pos]  # drafts that accepted more than `pos` tokens
            self.sd_per_pos.labels(*labels, str(pos)).inc(reached)

    def ended(self, endpoint: str, task: str, outcome: str) -> None:
        """A request that did not finish: cancelled (client left), timeout, error, rejected, shutdown."""
        self.requests.labels(endpoint, self.task_label(task), outcome).inc()

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
