"""Watching a request run: the trace, its JSON's schema and the terminal view.

    trace.py    `Trace`: the engine's step hooks for one request -> JSON-able records
    schema.py   those records, declared (TypedDicts), read by the views
    view.py     `TerminalView`: what `tokenmill inspect` prints (its command is cli/inspect.py)
The web page (server/static/, fed by server/inspect_routes.py) reads the same records.
Nothing is imported here: the schema stays light, the trace needs torch, the view rich.
"""
