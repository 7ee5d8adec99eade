"""`specedge serve`: an OpenAI-compatible HTTP server over one or more pipelines (docs/serve.md).

schemas.py validates request bodies, worker.py runs replicas (one pipeline each) behind a bounded
queue, sse.py formats responses and stream chunks, metrics.py keeps the Prometheus metrics,
app.py wires them into FastAPI routes. Importing this package needs fastapi, uvicorn and
prometheus-client (`pip install specedge[serve]`); the runtime itself does not.
"""
