"""`specedge serve` against hostile and odd clients, over real HTTP on loopback: bounded metrics,
the HTTP layer's read limits and error objects, start-up failures before the model loads, and
the shutdown on SIGTERM / SIGINT (a real `specedge serve` process, serve_harness.py holding its
target calls where a test needs a request in flight)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve import PROMPTS, Gate, complete, free_port, serving, wait_until  # noqa: E402

from specedge.runtime.api import load  # noqa: E402
from specedge.serve.metrics import DEFAULT_MAX_TASKS, OVERFLOW_TASK  # noqa: E402

HARNESS = Path(__file__).with_name("serve_harness.py")


@pytest.fixture(scope="module")
def bundle(tiny_bundle_factory):
    return tiny_bundle_factory()


@pytest.fixture(scope="module")
def pipe(bundle):
    p = load(bundle, threads=1)
    yield p
    p.close()


def samples(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def raw(
    port: int, data: bytes, *, half_close: bool = False, pause_after: float | None = None, timeout: float = 10.0
) -> tuple[float, bytes]:
    """Sends `data` on a fresh connection and reads until the server closes it (or `timeout`);
    returns the seconds that took and what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        t0 = time.monotonic()
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return time.monotonic() - t0, out


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)["error"]


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
        % (path.encode(), len(body), extra)
    ) + body


# ----------------------------------------------------------------------------- metrics


def test_task_labels_are_capped_and_the_rest_counted_as_other(pipe):
    with serving([pipe]) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        n = 700
        for i in range(n):
            r = c.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 1, "temperature": 0, "specedge": {"task": f"t{i}", "guard": False}},
            )
            assert r.status_code == 200, r.text
            assert r.json()["specedge"]["task"] == f"t{i}"  # the response keeps the client's label
        text = c.get("/metrics").text
        m = samples(s.url)
    tasks = {dict(lab).get("task") for (name, lab) in m if name == "specedge_requests_total"}
    assert len(tasks) == DEFAULT_MAX_TASKS + 1 and OVERFLOW_TASK in tasks
    ok = lambda task: m[("specedge_requests_total", (("endpoint", "completions"), ("outcome", "ok"), ("task", task)))]
    assert ok(OVERFLOW_TASK) == n - DEFAULT_MAX_TASKS and ok("t0") == 1 and ok(f"t{DEFAULT_MAX_TASKS - 1}") == 1
    assert all(dict(lab)["task"] in tasks for (_, lab) in m if "task" in dict(lab))
    # every family holds at most cap + overflow series per label set: the page stops growing
    assert len(text) < 1_000_000, len(text)


def test_metrics_cap_counts_default_apart_and_overflow_cannot_be_requested(pipe):
    with serving([pipe], max_tasks=2) as s:
        for task in ("a", "b", "c", "d", None, "a"):
            ext = {"task": task} if task else {}
            complete(s.client, PROMPTS[0], max_tokens=2, extra_body={"specedge": ext})
        m = samples(s.url)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "specedge": {"task": OVERFLOW_TASK}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "specedge.task"
    ok = lambda task: m.get(
        ("specedge_requests_total", (("endpoint", "completions"), ("outcome", "ok"), ("task", task)))
    )
    assert (ok("a"), ok("b"), ok("default"), ok(OVERFLOW_TASK), ok("c")) == (2, 1, 1, 2, None)


def test_spec_decode_counters_use_vllm_names_and_meanings(pipe):
    with serving([pipe]) as s:
        for _ in range(3):
            complete(s.client, PROMPTS[1], max_tokens=24, extra_body={"specedge": {"task": "code", "guard": False}})
        m = samples(s.url)
    lab = (("model_name", "tiny"), ("task", "code"))
    drafts = m[("specedge:spec_decode_num_drafts_total", lab)]
    drafted = m[("specedge:spec_decode_num_draft_tokens_total", lab)]
    accepted = m[("specedge:spec_decode_num_accepted_tokens_total", lab)]
    assert drafts == m[("specedge_target_calls_total", (("task", "code"),))] > 0
    assert drafted == m[("specedge_drafted_tokens_total", (("task", "code"),))]
    assert accepted == m[("specedge_accepted_tokens_total", (("task", "code"),))]
    per_pos = [
        m.get(
            ("specedge:spec_decode_num_accepted_tokens_per_pos_total", tuple(sorted((*lab, ("position", str(i)))))), 0
        )
        for i in range(4)
    ]
    assert sum(per_pos) == accepted  # each accepted token sits at one position
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= drafts


def test_metrics_render_off_the_event_loop(pipe):
    with serving([pipe]) as s:
        metrics = s.app.state.metrics
        render, entered, release = metrics.render, threading.Event(), threading.Event()

        def slow_render():
            entered.set()
            assert release.wait(30)
            return render()

        metrics.render = slow_render
        got = {}
        t = threading.Thread(target=lambda: got.update(r=httpx.get(s.url + "/metrics", timeout=60)))
        t.start()
        try:
            assert entered.wait(30)
            t0 = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=10).status_code == 200  # the loop is free meanwhile
            assert time.monotonic() - t0 < 5
        finally:
            release.set()
            t.join(60)
        assert got["r"].status_code == 200 and "# HELP specedge_requests_total" in got["r"].text


# ----------------------------------------------------------------------------- the HTTP layer


def test_http_layer_refusals_are_error_objects(pipe):
    with serving([pipe]) as s:
        body = b'{"prompt": "hi", "max_tokens": 2}'
        bad_length = post("/v1/completions", body).replace(b"Content-Length: %d" % len(body), b"Content-Length: 1x")
        status, err = status_and_error(raw(s.port, bad_length)[1])
        assert status == 400 and "not valid HTTP/1.1" in err["message"] and "Content-Length" in err["message"]
        status, err = status_and_error(
            raw(s.port, b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n")[1]
        )
        assert status == 431 and "over the server's limit of 65536 bytes" in err["message"]
        status, err = status_and_error(raw(s.port, b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")[1])
        assert status == 400 and set(err) == {"message", "type", "param", "code"}
        assert complete(s.client, PROMPTS[0], max_tokens=2).usage.completion_tokens == 2  # still serving
        m = samples(s.url)
        assert m[("specedge_errors_total", (("kind", "bad_request"),))] == 2
        assert m[("specedge_errors_total", (("kind", "too_large"),))] == 1


BODIES = [
    (b"", "the request body is empty", None),
    (b'{"prompt": "x", "temperature": NaN}', "invalid 'temperature': Input should be a finite number", "temperature"),
    (b'{"prompt": "x", "top_p": Infinity}', "invalid 'top_p': Input should be a finite number", "top_p"),
    (b'{"prompt": "x", "temperature": -Infinity}', "'temperature': Input should be a finite number", "temperature"),
    (b'{"prompt": "\xff"}', "the request body is not valid JSON (it is not UTF-8 text)", None),
    (b'{"prompt": "x", "max_tokens": 1e400}', "'max_tokens'", "max_tokens"),
    (b'{"prompt": {"a": 1}}', "invalid 'prompt': Input should be a valid string", "prompt"),
]


@pytest.mark.parametrize("body, fragment, param", BODIES, ids=[b[1] for b in BODIES])
def test_bodies_refused_with_the_field_and_the_rule(pipe, body, fragment, param):
    with serving([pipe]) as s:
        status, err = status_and_error(raw(s.port, post("/v1/completions", body, b"Connection: close\r\n"))[1])
    assert status == 400 and fragment in err["message"] and err["param"] == param, err
    assert "None" not in err["message"] and "\n" not in err["message"]


def test_a_client_that_half_closes_after_sending_gets_its_answer(pipe):
    with serving([pipe]) as s:
        want = complete(s.client, PROMPTS[0], max_tokens=8).choices[0].text
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).encode()
        _, out = raw(s.port, post("/v1/completions", body), half_close=True)
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"  # the server's probe: HTTP/1.1 clients skip it
        assert out.startswith(interim)
        head, _, payload = out[len(interim) :].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(payload)["choices"][0]["text"] == want
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}).encode()
        _, out = raw(s.port, post("/v1/completions", body), half_close=True)
        events = [line for line in out.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == want


def test_a_client_that_closes_while_queued_or_running_is_still_noticed(pipe):
    """Answering half-closed clients must not keep the requests of clients that left entirely."""
    gate = Gate(pipe)
    with serving([pipe], [gate], queue=4) as s:
        gate.hold_after(1)
        blocker = threading.Thread(target=lambda: complete(s.client, PROMPTS[0], max_tokens=8))
        blocker.start()
        assert gate.held.wait(60)
        running = s.scheduler.replicas[0].job
        body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 8}).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as c:
            c.sendall(post("/v1/completions", body))
            wait_until(lambda: s.scheduler.waiting == 1, "the request to wait in the queue")
        wait_until(lambda: s.scheduler.waiting == 0, "the queued request of the client that left to be dropped")
        assert not running.cancel.is_set()
        gate.release()
        blocker.join(60)
        key = ("specedge_requests_total", (("endpoint", "completions"), ("outcome", "cancelled"), ("task", "default")))
        wait_until(lambda: samples(s.url).get(key) == 1, "the cancelled request in the metrics")


def test_slow_heads_and_bodies_are_cut_off_and_others_still_served(pipe):
    with serving([pipe], header_timeout=0.5, body_timeout=0.5) as s:
        slow = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(20)]
        try:
            for i, c in enumerate(slow):  # half of them stop inside the head, half inside the body
                c.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                    if i % 2
                    else b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{"
                )
            assert complete(s.client, PROMPTS[0], max_tokens=2).usage.completion_tokens == 2
            t0 = time.monotonic()
            answers = []
            for c in slow:
                out = b""
                while chunk := c.recv(65536):
                    out += chunk
                answers.append(status_and_error(out))
            assert time.monotonic() - t0 < 5  # all closed by the server, about 0.5 s after they stalled
        finally:
            for c in slow:
                c.close()
        heads = [e for i, e in enumerate(answers) if i % 2]
        bodies = [e for i, e in enumerate(answers) if not i % 2]
        assert all(st == 408 and "request head did not arrive within 0.5 s" in e["message"] for st, e in heads)
        assert all(st == 408 and "request body did not arrive within 0.5 s" in e["message"] for st, e in bodies)
        # a connection that says nothing is closed too, without an answer
        elapsed, out = raw(s.port, b"")
        assert out == b"" and elapsed < 5
        # blank lines, which the parser skips, do not keep a connection open either
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            t0 = time.monotonic()
            try:
                for _ in range(40):
                    c.sendall(b"\r\n")
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert status_and_error(c.recv(65536))[0] == 408 and time.monotonic() - t0 < 3
        assert samples(s.url)[("specedge_errors_total", (("kind", "timeout"),))] == 21


def test_a_client_that_stops_reading_is_disconnected_after_the_write_timeout(pipe):
    with serving([pipe], write_timeout=0.5) as s:
        stats = {
            "tokens": 5,
            "prompt_tokens": 3,
            "tokens_per_s": 10.0,
            "speculative": True,
            "drafted": 8,
            "accepted": 4,
            "target_calls": 2,
            "accepted_histogram": [0, 1, 0, 1, 0],
        }
        for i in range(DEFAULT_MAX_TASKS):  # a /metrics page of a few hundred kB
            s.app.state.metrics.finished("chat", f"t{i}", stats, 0.1, 0.1, 0.2)
        with socket.socket() as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(("127.0.0.1", s.port))
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n" * 40)  # pipelined, never read
            wait_until(
                lambda: samples(s.url).get(("specedge_errors_total", (("kind", "timeout"),))) == 1,
                "the server to give up on the client that does not read",
                timeout=30,
            )
            c.settimeout(10)
            with pytest.raises((ConnectionResetError, AssertionError)):
                while c.recv(1 << 20):
                    pass
                raise AssertionError("closed")  # an orderly end after the data is also a close
        assert ("specedge_errors_total", (("kind", "internal"),)) not in samples(s.url)


def test_an_internal_error_is_one_log_line_and_a_500_object(pipe, caplog, capfd):
    encode = pipe.encode

    def broken(*a, **kw):
        raise RuntimeError("first line of a fault\nsecond line\nthird line")

    with serving([pipe]) as s:
        pipe.encode = broken
        try:
            with caplog.at_level("INFO", logger="specedge.serve"):
                r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        finally:
            pipe.encode = encode
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError"
    lines = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert lines == ["specedge serve: POST /v1/completions: internal error: RuntimeError: first line of a fault"]
    assert "Traceback" not in capfd.readouterr().err


# ----------------------------------------------------------------------------- start-up


def serve_cmd(bundle, *args, env=None, harness=False):
    entry = [str(HARNESS)] if harness else ["-m", "specedge", "serve"]
    return subprocess.Popen(
        [sys.executable, *entry, str(bundle), "--threads", "1", "--verify", "none", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, **(env or {})),
    )


@pytest.fixture(scope="module")
def broken_bundle(bundle, tmp_path_factory):
    """The tiny bundle with its target graph emptied: loading it fails, so a command that fails
    for another reason first has not loaded the model."""
    d = tmp_path_factory.mktemp("broken") / bundle.name
    shutil.copytree(bundle, d)
    (d / "target" / "model.onnx").write_bytes(b"")
    return d


def test_port_in_use_fails_before_the_model_loads(broken_bundle):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        p = serve_cmd(broken_bundle, "--port", str(port))
        _, err = p.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    assert p.returncode == 2 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use"), err
    assert elapsed < 30


def test_unresolvable_host_fails_before_the_model_loads(broken_bundle):
    p = serve_cmd(broken_bundle, "--host", "no-such-host.invalid", "--port", str(free_port()))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.strip().splitlines() == [err.strip()], err  # one line, no warning first
    assert err.startswith("error: cannot resolve --host 'no-such-host.invalid'"), err


def test_broken_bundle_really_fails_to_load(broken_bundle):
    """The control for the two tests above: with a free port the same command fails loading."""
    p = serve_cmd(broken_bundle, "--port", str(free_port()))
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and "cannot listen" not in err and "cannot resolve" not in err


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--grace", "0"], "--grace must be a finite number of seconds > 0"),
        (["--header-timeout", "inf"], "--header-timeout must be a finite number"),
        (["--body-timeout", "nan"], "--body-timeout must be a finite number"),
        (["--metrics-max-tasks", "-1"], "--metrics-max-tasks must be >= 0"),
        (["--ray", "--grace", "5"], "apply without --ray only"),
    ],
)
def test_new_options_are_checked(bundle, args, fragment):
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "serve", str(bundle), *args], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and p.stderr.startswith("error: ") and fragment in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- shutdown


class Held:
    """A `specedge serve` process (serve_harness.py) whose target calls hold after `free` while
    the hold file exists."""

    def __init__(self, bundle, tmp: Path, free: int, *args):
        self.hold = tmp / "hold"
        self.hold.touch()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = serve_cmd(
            bundle,
            "--port",
            str(self.port),
            "--queue",
            "4",
            *args,
            harness=True,
            env={"SPECEDGE_TEST_HOLD": str(self.hold), "SPECEDGE_TEST_FREE": str(free)},
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

        def up():
            assert self.proc.poll() is None, "".join(self.lines)
            try:
                return httpx.get(self.url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the server to listen", timeout=120)

    def held(self) -> bool:
        return Path(str(self.hold) + ".held").exists()

    def release(self) -> None:
        self.hold.unlink(missing_ok=True)

    def waiting(self) -> int:
        return httpx.get(self.url + "/health").json()["waiting"]

    def finish(self) -> int:
        self.release()
        try:
            rc = self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(30)
        return rc


def stream_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def run():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                out["status"] = r.status_code
                out["events"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        except Exception as e:  # noqa: BLE001 - asserted by the test
            out["exc"] = e

    t = threading.Thread(target=run)
    t.start()
    return t


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
        return False
    except httpx.ConnectError:
        return True


def test_sigterm_finishes_the_running_stream_and_answers_the_queue_503(bundle, pipe, tmp_path):
    want = pipe.generate(PROMPTS[0], max_new_tokens=24).text
    s = Held(bundle, tmp_path, 3)
    try:
        stream: dict = {}
        t = stream_in_thread(s.url, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stream": True}, stream)
        wait_until(s.held, "the stream's replica to be held mid-generation")
        queued: dict = {}
        q = threading.Thread(
            target=lambda: queued.update(
                r=httpx.post(s.url + "/v1/completions", timeout=60, json={"prompt": PROMPTS[1], "max_tokens": 4})
            )
        )
        q.start()
        wait_until(lambda: s.waiting() == 1, "the second request to wait in the queue")
        s.proc.send_signal(signal.SIGTERM)
        q.join(30)
        r = queued["r"]
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "shutdown"
        wait_until(lambda: refused(s.url), "the server to stop accepting connections", timeout=30)
        assert t.is_alive()  # the running stream is still held, not cut
        s.release()
        t.join(60)
    finally:
        rc = s.finish()
    assert stream["status"] == 200 and stream["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in stream["events"][:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want  # finished in full
    assert rc == 0, "".join(s.lines)
    assert any("stopped by SIGTERM" in line for line in s.lines) and not any("Traceback" in x for x in s.lines)


def test_a_draining_server_refuses_new_work_and_reports_stopping(pipe):
    with serving([pipe]) as s:
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        s.scheduler.drain()  # what the first signal does, before the listening socket closes
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "stopping"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["error"]["code"] == "shutdown"


def test_grace_period_ends_running_requests_with_an_error(bundle, tmp_path):
    s = Held(bundle, tmp_path, 3, "--grace", "1", "--replicas", "2")
    try:
        stream: dict = {}
        t = stream_in_thread(s.url, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stream": True}, stream)
        wait_until(s.held, "the stream's replica to be held mid-generation")
        whole: dict = {}  # on the other replica, held at its first call
        w = threading.Thread(
            target=lambda: whole.update(
                r=httpx.post(s.url + "/v1/completions", timeout=60, json={"prompt": PROMPTS[1], "max_tokens": 8})
            )
        )
        w.start()
        wait_until(lambda: httpx.get(s.url + "/health").json()["busy"] == 2, "both replicas to be busy")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        w.join(60)
        elapsed = time.monotonic() - t0
    finally:
        rc = s.finish()
    assert 0.9 < elapsed < 10
    assert stream["status"] == 200 and stream["events"][-1] == "[DONE]"
    err = json.loads(stream["events"][-2])["error"]
    assert err["code"] == "shutdown" and "shut down before this request finished" in err["message"]
    r = whole["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown" and r.headers["retry-after"] == "5"
    assert rc == 0 and any("2 request(s) ended before they finished" in line for line in s.lines), "".join(s.lines)


def test_second_signal_ends_streams_at_once_and_sigint_exits_130(bundle, tmp_path):
    s = Held(bundle, tmp_path, 3, "--grace", "60")
    try:
        stream: dict = {}
        t = stream_in_thread(s.url, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stream": True}, stream)
        wait_until(s.held, "the stream's replica to be held mid-generation")
        s.proc.send_signal(signal.SIGINT)
        wait_until(lambda: refused(s.url), "the server to stop accepting connections", timeout=30)
        assert t.is_alive()
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        t.join(60)
        assert time.monotonic() - t0 < 10  # not the 60 s grace
    finally:
        rc = s.finish()
    assert stream["events"][-1] == "[DONE]" and json.loads(stream["events"][-2])["error"]["code"] == "shutdown"
    assert rc == 130, "".join(s.lines)


def test_sigterm_while_the_model_loads_exits_0_after_cleanup(bundle, tmp_path):
    loading = tmp_path / "loading"
    loading.touch()
    port = free_port()
    p = serve_cmd(
        bundle,
        "--port",
        str(port),
        harness=True,
        env={"SPECEDGE_TEST_HOLD": str(tmp_path / "unused"), "SPECEDGE_TEST_LOAD_HOLD": str(loading)},
    )
    try:
        wait_until(lambda: Path(str(loading) + ".loading").exists() or p.poll() is not None, "the model to load")
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # the port is bound while the model loads
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "Traceback" not in err and " on http://" not in err, err
