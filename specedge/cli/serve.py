"""`specedge serve BUNDLE`: an OpenAI-compatible HTTP server (docs/serve.md).

Loads `--replicas` pipelines of the bundle (one KV cache each), puts a bounded queue in front
of them and serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics with
uvicorn. Binds to 127.0.0.1 unless told otherwise; `--api-key` (or SPECEDGE_API_KEY) requires
`Authorization: Bearer KEY` on every route but /health. The port is bound (and the host resolved)
before the model loads, so a port in use fails at once. SIGTERM stops the server gracefully
(exit 0), Ctrl-C too (exit 130); docs/serve.md ("Stopping") has the details.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

API_KEY_ENV = "SPECEDGE_API_KEY"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a bundle over an OpenAI-compatible HTTP API",
        description="Serve a bundle over the OpenAI HTTP API (chat and text completions, streaming, "
        "Prometheus metrics with acceptance per task). Needs the serve extra: pip install 'specedge[serve]'.",
    )
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="pipelines serving requests side by side, one KV cache each (default 1)",
    )
    p.add_argument(
        "--queue",
        type=int,
        default=16,
        metavar="N",
        help="requests that may wait for a replica; more are answered 429 (default 16)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="deadline of a request in seconds, queue wait included (default 300)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require Authorization: Bearer KEY (default: ${API_KEY_ENV} if set, else no key)",
    )
    p.add_argument(
        "--max-body", type=int, default=1 << 20, metavar="BYTES", help="largest request body accepted (default 1048576)"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a client has to send a request's head, else 408 (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a client has to send a request's body once its head is in, else 408 (default 30)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="S",
        help="at SIGTERM/SIGINT, seconds running requests get to finish before they are ended "
        "(default 8; a second signal ends them at once)",
    )
    p.add_argument(
        "--metrics-max-tasks",
        type=int,
        default=None,
        metavar="N",
        help="distinct `specedge.task` labels in /metrics; later ones are counted as '(other)' (default 64)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="max_tokens of a request that gives none (default 256)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        metavar="NAME",
        help="the model id clients see (default: the bundle folder's name)",
    )
    p.add_argument(
        "--draft",
        choices=("model", "ngram", "head"),
        default=None,
        help="drafter of every replica (default: the bundle's)",
    )
    p.add_argument(
        "--backend", default="auto", help="auto, ort-cpu, ort-cuda, ort-trt, tensorrt or torch (default auto)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="intra-op threads per ONNX Runtime session (default: the cores, shared out among replicas)",
    )
    p.add_argument(
        "--verify",
        choices=("full", "size", "none"),
        default="full",
        help="bundle file check at load (default full: sha256)",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="deploy on Ray Serve instead: --replicas Ray replicas of the same app (needs ray[serve])",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="Ray cluster to join with --ray (default: a local one, or $RAY_ADDRESS)",
    )
    p.add_argument("--ray-num-cpus", type=float, default=None, metavar="N", help="CPUs each Ray replica reserves")
    p.add_argument("--ray-num-gpus", type=float, default=0.0, metavar="N", help="GPUs each Ray replica reserves")
    p.set_defaults(func=run)
    return p


def check_args(args) -> str | None:
    """Checks that need no bundle; returns the API key in force."""
    from ..errors import UserError
    from ..runtime.api import MAX_THREADS

    if not 1 <= args.port <= 65535:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    if args.replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {args.replicas}")
    if args.queue < 0:
        raise UserError(f"--queue must be >= 0, got {args.queue}")
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise UserError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if args.max_body < 1024:
        raise UserError(f"--max-body must be >= 1024 bytes, got {args.max_body}")
    for name in ("header_timeout", "body_timeout", "grace"):
        v = getattr(args, name)
        if v is not None and not (0 < v < float("inf")):
            raise UserError(f"--{name.replace('_', '-')} must be a finite number of seconds > 0, got {v}")
    if args.metrics_max_tasks is not None and args.metrics_max_tasks < 0:
        raise UserError(f"--metrics-max-tasks must be >= 0, got {args.metrics_max_tasks}")
    if args.default_max_tokens < 1:
        raise UserError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise UserError(f"--threads must be in 1..{MAX_THREADS}, got {args.threads}")
    if args.model_name is not None and not args.model_name.strip():
        raise UserError("--model-name must not be empty")
    if not args.ray and (args.ray_address is not None or args.ray_num_cpus is not None or args.ray_num_gpus):
        raise UserError("--ray-address, --ray-num-cpus and --ray-num-gpus apply with --ray only")
    if args.ray and any(getattr(args, n) is not None for n in ("header_timeout", "body_timeout", "grace")):
        raise UserError(
            "--header-timeout, --body-timeout and --grace apply without --ray only "
            "(Ray Serve's own proxy reads the requests and stops the replicas)"
        )
    if args.ray_num_cpus is not None and not args.ray_num_cpus > 0:
        raise UserError(f"--ray-num-cpus must be > 0, got {args.ray_num_cpus}")
    if not args.ray_num_gpus >= 0:
        raise UserError(f"--ray-num-gpus must be >= 0, got {args.ray_num_gpus}")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and (not key or key != key.strip() or any(ord(c) < 33 or ord(c) > 126 for c in key)):
        raise UserError("the API key must be non-empty printable ASCII without spaces")
    return key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_replicas(args) -> list:
    from ..runtime.api import load

    threads = args.threads
    if threads is None and args.replicas > 1:
        threads = max(1, (os.cpu_count() or 1) // args.replicas)
    pipes = []
    try:
        for _ in range(args.replicas):
            # one replica owns the process's CPU: its target and draft share one spinning pool,
            # as `specedge generate` does; several replicas each keep their own pools
            pipes.append(
                load(
                    args.bundle,
                    backend=args.backend,
                    threads=threads,
                    draft=args.draft,
                    verify=args.verify,
                    shared_pool=args.replicas == 1,
                )
            )
    except BaseException:
        for p in pipes:
            p.close()
        raise
    return pipes


def _need_serve_packages() -> None:
    from ..errors import UserError

    missing = []
    for mod in ("fastapi", "uvicorn", "httptools", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise UserError(f"specedge serve needs {', '.join(missing)}: pip install 'specedge[serve]'")


def _warn_without_key(host: str, key: str | None) -> None:
    if not is_loopback(host) and key is None:
        print(
            f"warning: serving on {host} without an API key: anyone who can reach this port can use it "
            f"(set --api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )


class _Stopped(Exception):
    """SIGTERM while the model loads: ends the command after its cleanup."""


def _stop_on_sigterm(*_):
    raise _Stopped()


def run(args) -> int:
    import logging
    import signal
    from pathlib import Path

    from ..manifest import load_manifest

    key = check_args(args)
    _need_serve_packages()
    load_manifest(args.bundle, verify="none")  # a wrong folder fails here, before any weights load
    model = args.model_name or Path(args.bundle).resolve().name
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if getattr(args, "debug", False):
        logging.getLogger("specedge.serve").setLevel(logging.DEBUG)
    if args.ray:
        from ..errors import UserError

        try:
            import ray.serve  # noqa: F401
        except ImportError:
            raise UserError("specedge serve --ray needs Ray Serve: pip install 'specedge[ray]'") from None
        from ..serve.lifecycle import listen
        from ..serve.ray_app import serve_on_ray

        for s in listen(args.host, args.port):  # Ray's proxy binds it; a port in use fails here, first
            s.close()
        _warn_without_key(args.host, key)
        return serve_on_ray(args, model, key)

    from ..serve.app import create_app
    from ..serve.http import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, HttpLimits, uvicorn_config
    from ..serve.lifecycle import DEFAULT_GRACE, Server, listen
    from ..serve.metrics import DEFAULT_MAX_TASKS, ServeMetrics
    from ..serve.worker import Scheduler

    socks = listen(args.host, args.port)
    _warn_without_key(args.host, key)
    # until the server's own handlers take over, SIGTERM ends the command after its cleanup
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    pipes = []
    try:
        pipes = load_replicas(args)
        scheduler = Scheduler(pipes, args.queue)
        metrics = ServeMetrics(
            args.metrics_max_tasks if args.metrics_max_tasks is not None else DEFAULT_MAX_TASKS, model
        )
        app = create_app(
            scheduler,
            model,
            api_key=key,
            timeout=args.timeout,
            max_body=args.max_body,
            default_max_tokens=args.default_max_tokens,
            metrics=metrics,
        )
        limits = HttpLimits(
            header_timeout=args.header_timeout or DEFAULT_HEADER_TIMEOUT,
            body_timeout=args.body_timeout or DEFAULT_BODY_TIMEOUT,
            on_error=metrics.error,
        )
        server = Server(uvicorn_config(app, limits), scheduler, grace=args.grace or DEFAULT_GRACE)
        drafter = pipes[0].drafter.kind if pipes[0].drafter is not None else "none"
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"specedge serve: {model} on http://{host}:{args.port}/v1 ({args.replicas} replica(s), "
            f"queue {args.queue}, drafter {drafter}{', API key required' if key else ''})",
            file=sys.stderr,
            flush=True,
        )
        server.run(sockets=socks)
    except _Stopped:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        for s in socks:
            s.close()
        for p in pipes:
            p.close()
    if server.signal is not None:
        print(
            f"specedge serve: stopped by {signal.Signals(server.signal).name}"
            f"{f'; {server.cut_short} request(s) ended before they finished' if server.cut_short else ''}",
            file=sys.stderr,
            flush=True,
        )
    return 130 if server.signal == signal.SIGINT else 0
