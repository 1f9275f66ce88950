"""The OpenAI-compatible HTTP server: `tokenmill serve`.

    cli.py           the `serve` subcommand (uvicorn)
    app.py           the FastAPI app factory and routes
    async_engine.py  the engine loop thread and its asyncio bridge
    protocol.py      request models and checks, response and chunk shapes
    limits.py        the HTTP front's limits: head size and framing, body size and time,
                     the header timeout
    json_body.py     the one JSON reader of request bodies, for every route
    metrics.py       Prometheus text for /metrics, HTTP requests counted by status

Nothing is imported here: the CLI discovers `tokenmill.server.cli` on every run,
and FastAPI should only load when a server starts.
"""
