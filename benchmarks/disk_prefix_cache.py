"""Time to first token of a chat with a long system prompt, right after a server starts:
cold (an empty --prefix-cache-dir) against restarted (the folder a previous server wrote),
with the prompt's prefix in memory (a second request to the same server) as the floor.

    .venv/bin/python benchmarks/disk_prefix_cache.py [--model M] [--rules 220] [--runs 5]

Each run starts a real `tokenmill serve` on an empty folder, sends the chat (cold: the whole
prompt is computed) and sends it again (warm: served from memory), stops the server, starts
another on the same folder and sends it once more (restarted: the prefix read from disk).
Streamed, so the time is the first content chunk's. Medians over the runs; the disk hits
are read from /metrics, so a figure without them is not printed as a restart's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_fixture import server_process  # noqa: E402

from tokenmill import hub  # noqa: E402


def ttft(url: str, body: dict) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                return time.perf_counter() - start
    raise RuntimeError("the answer had no content")


def disk_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^tokenmill_prefix_cache_disk_hit_tokens_total (\S+)", text, re.M)
    return float(found[1]) if found else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model path or name [the default model]")
    p.add_argument("--rules", type=int, default=220, help="lines of the system prompt [220]")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    model = str(hub.resolve_model(args.model))
    system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(args.rules))
    body = {
        "model": "m", "stream": True, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
    }  # fmt: skip
    threads = ["--threads", str(args.threads)] if args.threads else []
    cold, warm, restarted = [], [], []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            serve = ("--model", model, "--served-model-name", "m", "--prefix-cache-dir", folder,
                     "--kv-cache-memory", "4096tok", *threads)  # fmt: skip
            with server_process(*serve) as server:
                cold.append(ttft(server.base_url, body))
                warm.append(ttft(server.base_url, body))
            with server_process(*serve) as server:
                restarted.append(ttft(server.base_url, body))
                hits = disk_hits(server.base_url)
            if hits == 0:
                raise SystemExit("the restarted server read nothing from disk")
        print(
            f"run {run + 1}: cold {cold[-1] * 1e3:.0f} ms, in memory {warm[-1] * 1e3:.0f} ms, "
            f"restarted {restarted[-1] * 1e3:.0f} ms ({hits:.0f} prompt tokens from disk)",
            flush=True,
        )
    c, w, r = (statistics.median(x) * 1e3 for x in (cold, warm, restarted))
    print(f"median TTFT: cold {c:.0f} ms, restarted (from disk) {r:.0f} ms = {c / r:.1f}x "
          f"faster, in memory {w:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
