"""What every streaming route shares: the server-sent-event framing. An error in a
stream is `to_api_error(exc).body()` (tokenmill/server/errors.py), as a whole response's
is."""

from __future__ import annotations

import json
from typing import Any


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json or literal>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"
