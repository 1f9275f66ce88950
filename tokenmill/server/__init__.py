"""The OpenAI-compatible HTTP server: `tokenmill serve`.

    cli.py           the `serve` subcommand (uvicorn)
    app.py           the FastAPI app factory and routes
    async_engine.py  the engine loop thread and its asyncio bridge
    protocol.py      request models and checks, response and chunk shapes
    metrics.py       Prometheus text for /metrics

Nothing is imported here: the CLI discovers `tokenmill.server.cli` on every run,
and FastAPI should only load when a server starts.
"""
