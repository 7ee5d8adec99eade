"""`specedge serve` over real HTTP on loopback: uvicorn in a thread on a free port, the official
`openai` client and httpx. Waits are on conditions (a gate that holds a replica's target calls,
the scheduler's counters), never on sleeps that guess how long something takes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specedge.runtime.api import load  # noqa: E402
from specedge.serve.app import create_app  # noqa: E402
from specedge.serve.http import HttpLimits, uvicorn_config  # noqa: E402
from specedge.serve.lifecycle import Server as LifecycleServer  # noqa: E402
from specedge.serve.worker import Scheduler  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
CHATS = ["hello", "What is 2 + 2?", "Write a poem", "Name a colour"]


def wait_until(cond, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Gate:
    """Holds a pipeline's target calls once `free` more have run, until `release()`: a request
    on that replica then stays in flight for exactly as long as a test needs."""

    def __init__(self, pipe):
        backend = pipe.generator.target.backend
        self.calls = 0
        self.free: int | None = None
        self.opened = threading.Event()
        self.held = threading.Event()
        for name in ("run", "argmax"):
            if hasattr(backend, name):
                setattr(backend, name, self._wrap(getattr(backend, name)))

    def _wrap(self, fn):
        def call(*a, **kw):
            self.calls += 1
            if self.free is not None and self.calls > self.free:
                self.held.set()
                assert self.opened.wait(120), "the gate was never released"
            return fn(*a, **kw)

        return call

    def hold_after(self, free: int) -> None:
        self.calls, self.free = 0, free
        self.held.clear()
        self.opened.clear()

    def release(self) -> None:
        self.free = None
        self.opened.set()


class Server:
    """A running app: base URL, openai client, scheduler, pipelines, gates."""

    def __init__(self, pipes, **options):
        self.pipes = pipes
        self.scheduler = Scheduler(pipes, options.pop("queue", 16))
        http_options = ("header_timeout", "body_timeout", "max_header_bytes", "write_timeout")
        options_http = {k: options.pop(k) for k in http_options if k in options}
        grace = options.pop("grace", 30.0)
        self.app = create_app(self.scheduler, "tiny", **options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        limits = HttpLimits(**options_http, on_error=self.app.state.metrics.error)
        self.server = LifecycleServer(uvicorn_config(self.app, limits), self.scheduler, grace=grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start")
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key=options.get("api_key") or "none", max_retries=0, timeout=120
        )

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)

    def metrics(self, headers=None) -> dict:
        """{(name, sorted label items): value} of every sample on /metrics."""
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }


@pytest.fixture(scope="module")
def bundle(tiny_bundle_factory):
    return tiny_bundle_factory()  # llama, fp32 target, int4 self draft, max_seq 128


@pytest.fixture(scope="module")
def pipes(bundle):
    ps = [load(bundle, threads=1) for _ in range(2)]
    yield ps
    for p in ps:
        p.close()


@pytest.fixture(scope="module")
def gates(pipes):
    return [Gate(p) for p in pipes]


@contextmanager
def serving(pipes, gates=(), **options):
    s = Server(pipes, **options)
    try:
        yield s
    finally:
        for g in gates:
            g.release()
        s.stop()


@pytest.fixture(scope="module")
def server(pipes):
    with serving(pipes[:1]) as s:
        yield s


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt=prompt, **kw)


def cli_generate(bundle, prompt, *args):
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", str(bundle), prompt, "--json", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# ----------------------------------------------------------------------------- answers


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert server.client.models.retrieve("tiny").owned_by == "specedge"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client.models.retrieve("gpt-4")
    h = httpx.get(server.url + "/health").json()
    assert h == {"status": "ok", "model": "tiny", "replicas": 1, "busy": 0, "waiting": 0}


def test_greedy_over_http_equals_specedge_generate(server, bundle):
    want = cli_generate(bundle, PROMPTS[1], "--max-new-tokens", "24")
    r = complete(server.client, PROMPTS[1], max_tokens=24)
    assert r.choices[0].text == want["text"]
    assert (
        r.usage.completion_tokens == len(want["token_ids"]) and r.usage.prompt_tokens == want["stats"]["prompt_tokens"]
    )
    assert r.choices[0].finish_reason == {"length": "length", "eos": "stop"}[want["finish_reason"]]
    want_chat = cli_generate(bundle, CHATS[0], "--chat", "--max-new-tokens", "20")
    c = chat(server.client, CHATS[0], max_tokens=20)
    assert c.choices[0].message.content == want_chat["text"] and c.choices[0].message.role == "assistant"
    assert c.usage.completion_tokens == len(want_chat["token_ids"])
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-") and c.model == "tiny"
    ext = c.model_extra["specedge"]
    assert ext["speculative"] is True and ext["drafter"] == "model" and 0 <= ext["acceptance_rate"] <= 1
    assert ext["task"] == "default" and ext["replica"] == 0


def test_streamed_chat_and_completion_equal_whole_answers(server):
    whole = chat(server.client, CHATS[1], max_tokens=24)
    chunks = list(chat(server.client, CHATS[1], max_tokens=24, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    # include_usage: OpenAI's form, a last chunk without choices
    inc = list(chat(server.client, CHATS[1], max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert inc[-1].choices == [] and inc[-1].usage.total_tokens == whole.usage.total_tokens
    assert inc[-2].usage is None and inc[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    wc = complete(server.client, PROMPTS[0], max_tokens=24)
    sc = list(complete(server.client, PROMPTS[0], max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in sc) == wc.choices[0].text
    assert sc[-1].usage.completion_tokens == wc.usage.completion_tokens
    # the raw stream: server-sent events ending with data: [DONE]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings_and_max_tokens(server):
    full = complete(server.client, PROMPTS[0], max_tokens=40).choices[0].text
    assert len(full) > 12
    stop = full[6:10]
    cut = complete(server.client, PROMPTS[0], max_tokens=40, stop=[stop, "\x00never"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = list(complete(server.client, PROMPTS[0], max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    short = complete(server.client, PROMPTS[0], max_tokens=5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    assert full.startswith(short.choices[0].text)
    one = chat(server.client, CHATS[0], max_completion_tokens=3)
    assert one.usage.completion_tokens == 3


def test_sampling_seed_and_speculation_switch(server):
    a = complete(server.client, PROMPTS[2], temperature=0.9, top_p=0.9, seed=7, max_tokens=16, extra_body={"top_k": 30})
    b = complete(server.client, PROMPTS[2], temperature=0.9, top_p=0.9, seed=7, max_tokens=16, extra_body={"top_k": 30})
    assert a.choices[0].text == b.choices[0].text
    greedy = complete(server.client, PROMPTS[2])
    for ext in ({"speculation": False}, {"drafter": "none"}, {"spec_tokens": 2}, {"drafter": "model", "guard": False}):
        r = complete(server.client, PROMPTS[2], extra_body={"specedge": ext})
        assert r.choices[0].text == greedy.choices[0].text, ext  # greedy: exact whatever the speculation
        assert r.model_extra["specedge"]["speculative"] is ("speculation" not in ext and ext.get("drafter") != "none")
    assert (
        complete(server.client, PROMPTS[2], extra_body={"specedge": {"spec_tokens": 2}}).model_extra["specedge"]["k"]
        == 2
    )


# ----------------------------------------------------------------------------- concurrency


def test_16_concurrent_clients_get_their_own_answers(pipes):
    with serving(pipes, queue=16) as s:
        jobs = [(i, PROMPTS[i % 4] if i % 2 else CHATS[i % 4], i % 3 == 0) for i in range(16)]

        def ask(prompt, is_chat, stream):
            if is_chat:
                if stream:
                    return "".join(
                        c.choices[0].delta.content or "" for c in chat(s.client, prompt, max_tokens=24, stream=True)
                    )
                return chat(s.client, prompt, max_tokens=24).choices[0].message.content
            if stream:
                return "".join(c.choices[0].text for c in complete(s.client, prompt, max_tokens=24, stream=True))
            return complete(s.client, prompt, max_tokens=24).choices[0].text

        want = {key: ask(*key, False) for key in {(p, i % 2 == 0) for i, p, _ in jobs}}
        got, errors = {}, []

        def worker(i, prompt, stream):
            try:
                got[i] = ask(prompt, i % 2 == 0, stream)
            except Exception as e:  # noqa: BLE001 - recorded and asserted below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert all(got[i] == want[(p, i % 2 == 0)] for i, p, _ in jobs)
        m = s.metrics()
        assert sum(v for (n, lab), v in m.items() if n == "specedge_requests_total") == 16 + len(want)
        assert s.scheduler.busy == 0 and s.scheduler.waiting == 0


def test_full_queue_answers_429_with_retry_after(pipes, gates):
    with serving(pipes[:1], gates, queue=1) as s:
        want = complete(s.client, PROMPTS[0]).choices[0].text
        gates[0].hold_after(1)  # the first request holds the replica after its prefill
        out = {}
        first = threading.Thread(target=lambda: out.update(a=complete(s.client, PROMPTS[0]).choices[0].text))
        first.start()
        assert gates[0].held.wait(60)
        second = threading.Thread(target=lambda: out.update(b=complete(s.client, PROMPTS[0]).choices[0].text))
        second.start()
        wait_until(lambda: s.scheduler.waiting == 1, "the second request to wait in the queue")
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full" and "queue is full" in r.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            complete(s.client, PROMPTS[1])
        gates[0].release()
        first.join(120)
        second.join(120)
        assert out == {"a": want, "b": want}  # the two queued requests are served in full
        m = s.metrics()
        assert m[("specedge_errors_total", (("kind", "queue_full"),))] == 2
        assert (
            m[("specedge_requests_total", (("endpoint", "completions"), ("outcome", "rejected"), ("task", "default")))]
            == 2
        )


def test_client_disconnect_mid_stream_frees_the_replica(pipes, gates):
    with serving(pipes[:1], gates, queue=4) as s:
        want = complete(s.client, PROMPTS[0], max_tokens=100)
        assert want.usage.completion_tokens == 100
        gates[0].hold_after(4)
        body = {"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # kept referenced: a dropped line iterator closes the response
            first = json.loads(next(line for line in lines if line)[6:])
            assert first["choices"][0]["text"]
            assert gates[0].held.wait(60)  # the replica is mid-generation
            job = s.scheduler.replicas[0].job
            assert job is not None and not job.cancel.is_set()
        # the connection is closed: the server notices and cancels the job at its next round
        wait_until(job.cancel.is_set, "the server to cancel the job of the client that left")
        calls = gates[0].calls
        gates[0].release()
        wait_until(lambda: s.scheduler.busy == 0, "the replica to be free")
        assert gates[0].calls - calls <= 3  # stopped after the round in flight, not at max_tokens
        key = ("specedge_requests_total", (("endpoint", "completions"), ("outcome", "cancelled"), ("task", "default")))
        wait_until(lambda: s.metrics().get(key) == 1, "the cancelled request in the metrics")
        assert complete(s.client, PROMPTS[0], max_tokens=100).choices[0].text == want.choices[0].text


def test_request_deadline_answers_504(pipes, gates):
    with serving(pipes[:1], gates, queue=4, timeout=0.5) as s:
        gates[0].hold_after(2)
        with pytest.raises(openai.APIStatusError) as e:
            complete(s.client, PROMPTS[3], max_tokens=50)
        assert e.value.status_code == 504 and "deadline of 0.5 s" in e.value.message
        gates[0].release()
        wait_until(lambda: s.scheduler.busy == 0, "the replica to be free")
        gates[0].hold_after(3)  # the prefill and two rounds: the stream has started when it holds
        with httpx.stream(
            "POST",
            s.url + "/v1/completions",
            json={"prompt": PROMPTS[3], "max_tokens": 50, "temperature": 0, "stream": True},
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "timeout"  # mid-stream: an error event, then [DONE]
        gates[0].release()
        wait_until(lambda: s.scheduler.busy == 0, "the replica to be free")
        assert s.metrics()[("specedge_errors_total", (("kind", "timeout"),))] == 2
        assert complete(s.client, PROMPTS[3], max_tokens=8).usage.completion_tokens == 8


def test_conversation_continues_on_the_replica_that_caches_it(pipes, gates):
    with serving(pipes, gates, queue=4) as s:
        gates[0].hold_after(0)  # replica 0 is busy with something else
        blocker = threading.Thread(target=lambda: complete(s.client, PROMPTS[0], max_tokens=4))
        blocker.start()
        assert gates[0].held.wait(60)
        history = [{"role": "user", "content": "Tell me about the sea and the ships on it, please."}]
        first = s.client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)
        assert first.model_extra["specedge"]["replica"] == 1
        gates[0].release()
        blocker.join(60)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And the fish?"},
        ]
        second = s.client.chat.completions.create(model="tiny", messages=history, max_tokens=12, temperature=0)
        ext = second.model_extra["specedge"]
        assert ext["replica"] == 1 and ext["prefix_reused_tokens"] >= 16  # both idle: the one with the cache
        fresh = pipes[0].generate(messages=history, max_new_tokens=12)
        assert second.choices[0].message.content == fresh.text  # reuse changes nothing in the answer


# ----------------------------------------------------------------------------- metrics, auth, bad input


def test_metrics_count_requests_and_acceptance_per_task(pipes):
    with serving(pipes[:1]) as s:
        for task, n in (("code", 2), ("chat", 1)):
            for _ in range(n):
                # guard off: the tiny int4 self-draft cannot pay on a CPU, so with the guard (and its
                # fallback carried over from earlier requests) these requests would not draft at all
                complete(s.client, PROMPTS[1], max_tokens=20, extra_body={"specedge": {"task": task, "guard": False}})
        plain = complete(
            s.client, PROMPTS[1], max_tokens=20, extra_body={"specedge": {"task": "plain", "speculation": False}}
        )
        m = s.metrics()
        ok = lambda task: m[
            ("specedge_requests_total", (("endpoint", "completions"), ("outcome", "ok"), ("task", task)))
        ]
        assert ok("code") == 2 and ok("chat") == 1 and ok("plain") == 1
        assert m[("specedge_generated_tokens_total", (("task", "code"),))] == 40
        assert m[("specedge_time_to_first_token_seconds_count", (("task", "code"),))] == 2
        assert m[("specedge_queue_wait_seconds_count", ())] == 4
        for task in ("code", "chat"):
            drafted = m[("specedge_drafted_tokens_total", (("task", task),))]
            accepted = m[("specedge_accepted_tokens_total", (("task", task),))]
            calls = m[("specedge_target_calls_total", (("task", task),))]
            assert drafted > 0 and m[("specedge_acceptance_rate", (("task", task),))] == pytest.approx(
                accepted / drafted
            )
            assert m[("specedge_mean_accepted_tokens", (("task", task),))] == pytest.approx((accepted + calls) / calls)
        assert ("specedge_acceptance_rate", (("task", "plain"),)) not in m  # target-only: no acceptance to report
        assert plain.model_extra["specedge"]["speculative"] is False
        assert ("specedge_guard_fallbacks_total", (("task", "code"),)) in m


def test_api_key_refuses_missing_and_wrong_keys(pipes):
    with serving(pipes[:1], api_key="s3cret-key") as s:
        assert complete(s.client, PROMPTS[0], max_tokens=2).usage.completion_tokens == 2
        for key in ("wrong", "s3cret-key-not"):
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="valid API key"):
                bad.models.list()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "missing API key" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Basic s3cret-key"}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # for load balancers; tells nothing
        m = s.metrics(headers={"Authorization": "Bearer s3cret-key"})
        assert m[("specedge_errors_total", (("kind", "unauthorized"),))] == 5


MALFORMED = [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", [1, 2], "must be a JSON object"),
    ("/v1/chat/completions", {}, "missing required parameter 'messages'"),
    ("/v1/chat/completions", {"messages": []}, "'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "'messages.0.role'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "'messages.0.content"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "'temperature'"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "'top_p'"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "'max_tokens'"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "'max_tokens'"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "only n = 1"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop strings"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "must not be empty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs are not supported"),
    ("/v1/completions", {"prompt": ""}, "the prompt is empty"),
    ("/v1/completions", {"prompt": "word " * 300}, "context holds 128"),
    ("/v1/completions", {"prompt": [10**9]}, "token ids must be in"),
    ("/v1/completions", {"prompt": "x", "specedge": {"spec_tokens": 99}}, "'specedge.spec_tokens'"),
    ("/v1/completions", {"prompt": "x", "specedge": {"turbo": True}}, "'specedge.turbo'"),
    ("/v1/completions", {"prompt": "x", "specedge": {"drafter": "ngram"}}, "this server drafts with 'model'"),
    ("/v1/completions", {"prompt": "x", "specedge": {"task": "has spaces"}}, "'specedge.task'"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        "tools are not supported",
    ),
]


@pytest.mark.parametrize("path, body, fragment", MALFORMED, ids=[m[2] for m in MALFORMED])
def test_malformed_requests_get_400_with_an_error_object(server, path, body, fragment):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert fragment in err["message"], err["message"]
    assert "Traceback" not in r.text and "\n" not in err["message"]


def test_oversized_bodies_and_unknown_routes_get_error_objects(server):
    big = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * (2 << 20)})
    assert big.status_code == 413 and "over the server's limit of 1048576 bytes" in big.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    nf = httpx.get(server.url + "/v1/nothing")
    assert nf.status_code == 404 and nf.json()["error"]["message"] == "Not Found"
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    assert complete(server.client, PROMPTS[0], max_tokens=2).usage.completion_tokens == 2  # still serving


# ----------------------------------------------------------------------------- the command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_specedge_serve_command(bundle):
    port = free_port()
    env = dict(os.environ, SPECEDGE_API_KEY="k3y")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specedge",
            "serve",
            str(bundle),
            "--port",
            str(port),
            "--threads",
            "1",
            "--verify",
            "size",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0)

        def up():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read()
                return False

        wait_until(up, "specedge serve to listen", timeout=120)
        r = complete(client, PROMPTS[1], max_tokens=6, extra_body={"specedge": {"task": "code"}})
        assert r.usage.completion_tokens == 6 and r.model == bundle.name
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert f"on http://127.0.0.1:{port}/v1" in err and "API key required" in err
    log = [line for line in err.splitlines() if line.startswith("specedge serve: completions ok")]
    assert len(log) == 1 and "task=code" in log[0] and "tokens=6" in log[0] and "acceptance=" in log[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--port", "0"], "--port must be in 1..65535"),
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--queue", "-1"], "--queue must be >= 0"),
        (["--timeout", "0"], "--timeout must be a finite number"),
        (["--max-body", "10"], "--max-body must be >= 1024"),
        (["--api-key", "has space"], "printable ASCII without spaces"),
        (["--ray-num-gpus", "1"], "apply with --ray only"),
        (["--ray", "--ray-num-cpus", "0"], "--ray-num-cpus must be > 0"),
    ],
)
def test_serve_bad_arguments(bundle, args, fragment):
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "serve", str(bundle), *args], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()] and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: ") and fragment in p.stderr, p.stderr


def test_serve_missing_bundle(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "serve", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- slow: the real model, Ray Serve


@pytest.mark.slow
def test_default_bundle_over_http(default_bundle):
    # per-session pools: a process-wide shared pool (what `specedge serve` makes in its own process)
    # would refuse every later test's load(threads=1) in this pytest process
    pipe = load(default_bundle, threads=2)
    try:
        questions = [
            "Name three colours.",
            "What is the capital of France?",
            "Write a haiku about the sea.",
            "def fibonacci(n):",
        ]
        want = {q: pipe.generate(messages=[{"role": "user", "content": q}], max_new_tokens=48).text for q in questions}
        want_code = pipe.generate(questions[3], max_new_tokens=48).text
        with serving([pipe], queue=8) as s:
            for q in questions:
                r = chat(s.client, q, max_tokens=48, extra_body={"specedge": {"task": "chat"}})
                assert r.choices[0].message.content == want[q]
            streamed = chat(s.client, questions[0], max_tokens=48, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == want[questions[0]]
            code = complete(s.client, questions[3], max_tokens=48, extra_body={"specedge": {"task": "code"}})
            assert code.choices[0].text == want_code
            got, errors = {}, []

            def worker(q):
                try:
                    got[q] = chat(s.client, q, max_tokens=48, extra_body={"specedge": {"task": "chat"}})
                except Exception as e:  # noqa: BLE001 - asserted below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(q,)) for q in questions]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            assert not errors and {q: r.choices[0].message.content for q, r in got.items()} == want
            m = s.metrics()
            assert (
                m[("specedge_requests_total", (("endpoint", "chat"), ("outcome", "ok"), ("task", "chat")))] == 8
            )  # 4 one by one, 4 at once
            assert 0 < m[("specedge_acceptance_rate", (("task", "chat"),))] <= 1
            assert m[("specedge_mean_accepted_tokens", (("task", "code"),))] >= 1
    finally:
        pipe.close()


@pytest.mark.slow
def test_ray_serve_two_replicas(bundle):
    pytest.importorskip("ray.serve")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specedge",
            "serve",
            str(bundle),
            "--ray",
            "--replicas",
            "2",
            "--threads",
            "1",
            "--ray-num-cpus",
            "1",
            "--queue",
            "0",
            "--port",
            str(port),
            "--verify",
            "size",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"

        def up():  # the command says so once Ray reports every replica running
            assert proc.poll() is None, "".join(lines)
            return any("Ray Serve, 2 replica(s)" in line for line in lines)

        wait_until(up, "Ray Serve to run both replicas", timeout=300)
        with load(bundle, threads=1) as pipe:
            want = {p: pipe.generate(p, max_new_tokens=100).text for p in PROMPTS[:2]}
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        got, errors = [], []
        barrier = threading.Barrier(8)

        def worker(i):
            try:
                barrier.wait(60)
                prompt = PROMPTS[i % 2]
                r = complete(client, prompt, max_tokens=100)
                got.append((r.choices[0].text == want[prompt], r.model_extra["specedge"]["instance"]))
            except Exception as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert all(ok for ok, _ in got) and len(got) == 8
        # one request at a time per replica (--queue 0): requests in flight together use both
        assert len({inst for _, inst in got}) == 2
        streamed = complete(client, PROMPTS[0], max_tokens=100, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want[PROMPTS[0]]
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "n": 2})
        assert bad.status_code == 400 and "only n = 1" in bad.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(120)
        reader.join(60)
    assert proc.returncode == 0, "".join(lines)[-3000:]


class _FakeStream:
    def __init__(self, ids):
        self.result = f"result of {ids}"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        yield "piece"


class _FakePipeline:
    """What the Scheduler uses of a pipeline: stream() and the target's reusable()."""

    class generator:  # noqa: N801 - mirrors Pipeline.generator.target
        class target:  # noqa: N801
            @staticmethod
            def reusable(ids):
                return 0

    def stream(self, token_ids, **kw):
        return _FakeStream(token_ids)


def test_a_replica_is_free_when_its_requester_hears_the_end():
    """Ray's router (and any client) sends a replica its next request as soon as the last one
    answered; with --queue 0 that request must be taken, not refused as a full queue (the race
    that gave test_ray_serve_two_replicas a 429 under load)."""
    from specedge.serve.worker import Job

    sched = Scheduler([_FakePipeline()], 0)
    sched.start()
    outcomes, done = [], threading.Event()

    def chain(n):
        def emit(ev):
            if ev[0] == "piece":
                return
            outcomes.append(ev)
            if n < 50:
                try:  # from the replica thread, the moment the final event is out
                    sched.submit(Job([n + 1], {}, chain(n + 1)))
                except Exception as e:  # noqa: BLE001 - asserted below
                    outcomes.append(("refused", e))
                    done.set()
            else:
                done.set()

        return emit

    try:
        sched.submit(Job([0], {}, chain(0)))
        assert done.wait(60)
        assert [o[0] for o in outcomes] == ["done"] * 51, outcomes[-1]
        assert outcomes[-1][1] == "result of [50]"
    finally:
        sched.close()
