"""`specedge serve --ray`: the same app as a Ray Serve deployment of N replicas.

Each Ray replica is a process (an actor) that loads one pipeline and serves the app of app.py
over a one-replica Scheduler; Ray's HTTP proxy routes requests among the replicas, on one machine
or across a Ray cluster (docs/serve.md shows a multi-node one). Ray reserves `num_cpus` /
`num_gpus` per replica; a replica takes at most `queue + 1` requests at a time (one running, the
rest in its own queue), and Ray holds the others until a replica has room.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ray import serve

from .app import create_app
from .metrics import DEFAULT_MAX_TASKS
from .worker import Scheduler

__all__ = ["SpecedgeDeployment", "build", "serve_on_ray"]


@serve.ingress()
class SpecedgeDeployment:
    """One Ray replica: the pipeline is loaded when Ray builds the app on the replica."""

    def __init__(self, config: dict):
        self.config = config

    def __serve_build_asgi_app__(self):
        import logging

        from ..runtime.api import load

        logging.getLogger("specedge.serve").setLevel(logging.INFO)  # the per-request line, in Ray's replica log
        c = self.config
        pipe = load(c["bundle"], **c["load"])
        scheduler = Scheduler([pipe], c["queue"])
        scheduler.start()
        try:
            instance = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - a name for the logs only
            instance = str(os.getpid())
        return create_app(
            scheduler,
            c["model"],
            api_key=c["api_key"],
            timeout=c["timeout"],
            max_body=c["max_body"],
            default_max_tokens=c["default_max_tokens"],
            instance=instance,
            max_tasks=c["max_tasks"],
        )


def build(config: dict, replicas: int, num_cpus: float, num_gpus: float):
    """The Ray Serve application: `replicas` copies of SpecedgeDeployment(config)."""
    # the replicas import specedge from where this process did (a source checkout works too);
    # on a cluster, every node needs specedge and the bundle at the same paths
    pkg_parent = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([pkg_parent, *filter(None, [os.environ.get("PYTHONPATH")])])
    options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
    dep = serve.deployment(
        SpecedgeDeployment,
        name="specedge",
        num_replicas=replicas,
        ray_actor_options=options,
        max_ongoing_requests=config["queue"] + 1,
    )
    return dep.bind(config)


def serve_on_ray(args, model: str, api_key: str | None) -> int:
    import ray

    threads = args.threads or max(1, int(args.ray_num_cpus or 1))
    num_cpus = args.ray_num_cpus if args.ray_num_cpus is not None else float(threads)
    config = {
        "bundle": str(Path(args.bundle).resolve()),
        "model": model,
        "queue": args.queue,
        "timeout": args.timeout,
        "max_body": args.max_body,
        "default_max_tokens": args.default_max_tokens,
        "api_key": api_key,
        "max_tasks": args.metrics_max_tasks if args.metrics_max_tasks is not None else DEFAULT_MAX_TASKS,
        "load": {
            "backend": args.backend,
            "threads": threads,
            "draft": args.draft,
            "verify": args.verify,
            "shared_pool": True,
        },  # a replica owns its process: one spinning pool, as `generate` has
    }
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build(config, args.replicas, num_cpus, args.ray_num_gpus), name="specedge", route_prefix="/")
        print(
            f"specedge serve: {model} on http://{args.host}:{args.port}/v1 (Ray Serve, {args.replicas} replica(s) "
            f"of {num_cpus:g} CPU / {args.ray_num_gpus:g} GPU, queue {args.queue} each"
            f"{', API key required' if api_key else ''})",
            file=sys.stderr,
            flush=True,
        )
        import signal
        import threading

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        interrupted = False
        try:
            stop.wait()
        except KeyboardInterrupt:
            interrupted = True
    finally:
        serve.shutdown()
        ray.shutdown()
    return 130 if interrupted else 0  # as without --ray: SIGTERM is a clean stop, Ctrl-C an interrupt
