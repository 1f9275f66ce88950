"""Prometheus metrics for GET /metrics, in the text exposition format (version 0.0.4).

Written by hand rather than with prometheus_client: the server needs three
histograms and a few gauges and counters, which is a page of code, not a
dependency. Histograms are observed by the engine thread and rendered by the
event loop, so each guards its counts with a lock. Gauges and counters are read
fresh from the engine at every scrape (see AsyncEngine.stats).

Speculative decoding (engine/speculative.py, `serve --speculative`) adds, labelled by
method, vLLM's spec_decode series under tokenmill's prefix:
`tokenmill_spec_decode_num_drafts_total` (verification steps),
`..._num_draft_tokens_total` (guesses verified), `..._num_accepted_tokens_total` and the
gauge `tokenmill_spec_decode_draft_acceptance_rate` (accepted / draft tokens). They are
absent while speculation is off. `tokenmill_kv_cache_bytes_per_token` is what one token's
K and V take in the cache over all layers, at the cache's dtype (`--kv-cache-dtype`).

HTTP requests are counted by `CountRequests`, the outermost middleware, by the status
code the client got: `tokenmill_http_requests_total{code="..."}`, where 499 (nginx's
"client closed request") counts every response the client left before its end, a
stream cut after its 200 header included. `tokenmill_http_requests_in_flight` counts
/v1 requests being answered.

Bucket bounds follow vLLM's, so dashboards built for it read these the same way.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.asgi import HTTPMiddleware

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def render_sample(
    name: str, help_text: str, kind: str, value: float, labels: dict[str, str] | None = None
) -> str:
    """One gauge or counter as exposition text."""
    sample = f"{name}{_labels(labels or {})} {_number(value)}"
    return "\n".join([*_header(name, help_text, kind), sample])


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help_text = name, help_text
        self.bounds = (*buckets, math.inf)
        self._counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def render(self) -> str:
        return "\n".join([*_header(self.name, self.help_text, "histogram"), *self.samples()])

    def samples(self, labels: str = "") -> list[str]:
        """The sample lines (no header); labels: 'model="a",' to put before le."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = []
        cumulative = 0
        for bound, count in zip(self.bounds, counts, strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{{labels}le="{_number(bound)}"}} {cumulative}')
        tail = f"{{{labels.rstrip(',')}}}" if labels else ""
        lines += [
            f"{self.name}_sum{tail} {_number(total)}",
            f"{self.name}_count{tail} {cumulative}",
        ]
        return lines


@dataclass(frozen=True)
class EngineStats:
    running: int  # sequences in the running batch
    waiting: int  # sequences in the scheduler's queue plus those not yet handed to it
    blocks_used: int  # KV blocks off the free list
    blocks_free: int
    blocks_held: int  # KV blocks with ref_count > 0: owned by live requests
    prefix_cache_hit_rate: float  # prompt tokens served from the prefix cache / prompt tokens
    prompt_tokens: int  # prompt tokens of every sequence added
    generation_tokens: int  # tokens generated
    kv_bytes_per_token: int = 0  # K and V of one token, all layers, at the cache's dtype
    # the prefix cache on disk (--prefix-cache-dir): prompt tokens read back from it, and
    # the blocks it holds
    prefix_cache_disk_hit_tokens: int = 0
    prefix_cache_disk_blocks: int = 0
    # LLMEngine.speculative_stats(): {} while speculation is off
    speculative: dict[str, int | float | str] = field(default_factory=dict)


class HTTPRequests:
    """Requests answered, by status code, and API requests in flight. Only the event loop
    writes these; a scrape reads them on the same loop."""

    def __init__(self) -> None:
        self.by_code: Counter[int] = Counter()
        self.in_flight = 0

    def render(self) -> str:
        name = "tokenmill_http_requests_total"
        lines = _header(
            name,
            "HTTP requests answered, by status code (499: the client left before the end).",
            "counter",
        )
        lines += [f'{name}{{code="{code}"}} {n}' for code, n in sorted(self.by_code.items())]
        gauge = render_sample(
            "tokenmill_http_requests_in_flight",
            "API (/v1) requests being answered.",
            "gauge",
            self.in_flight,
        )
        return "\n".join(lines) + "\n" + gauge


class CountRequests(HTTPMiddleware):
    """Count each HTTP request under the status code its client got."""

    def __init__(self, app: ASGIApp, *, requests: HTTPRequests):
        super().__init__(app)
        self.requests = requests

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        status: int | None = None
        finished = False

        async def counted_send(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True

        api = scope["path"].startswith("/v1/")
        self.requests.in_flight += api
        try:
            await self.app(scope, receive, counted_send)
        except BaseException:
            if status is None:
                status, finished = 500, True  # ServerErrorMiddleware answers it
            raise
        finally:
            self.requests.in_flight -= api
            self.requests.by_code[status if finished and status else CLIENT_CLOSED_REQUEST] += 1


def render_info(name: str, help_text: str, labels: dict[str, str]) -> str:
    """An info metric: a gauge of value 1 whose labels carry the facts (Prometheus' *_info)."""
    quoted = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels.items()
    )
    return "\n".join([*_header(name, help_text, "gauge"), f"{name}{{{quoted}}} 1"])


class ServerMetrics:
    """The latency histograms and HTTP counters, plus rendering of the whole /metrics page.
    `info`: labels of tokenmill_build_info (version, kernel instruction set, weight format)."""

    def __init__(self, info: dict[str, str] | None = None) -> None:
        self.info = dict(info or {})
        self.http = HTTPRequests()
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "tokenmill_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request.",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token (finished requests only).",
            E2E_BUCKETS,
        )

    def render(self, stats: EngineStats) -> str:
        parts = [render_sample(*sample) for sample in engine_samples(stats)]
        parts.append(self.http.render())
        if self.info:
            parts.append(render_info("tokenmill_build_info",
                                     "What this server runs: version, kernels, weights.", self.info))  # fmt: skip
        parts += [h.render() for h in self.histograms()]
        return "\n".join(parts) + "\n"

    def histograms(self) -> tuple[Histogram, Histogram, Histogram]:
        return self.ttft, self.itl, self.e2e


Sample = tuple[str, str, str, float, dict[str, str]]  # name, help, kind, value, labels


def engine_samples(stats: EngineStats) -> list[Sample]:
    """(name, help, kind, value, labels) of each gauge and counter one engine reports."""
    plain = [
        ("tokenmill_requests_running", "Sequences in the running batch.", "gauge",
         stats.running),
        ("tokenmill_requests_waiting", "Sequences waiting to be scheduled.", "gauge",
         stats.waiting),
        ("tokenmill_kv_blocks_used", "KV cache blocks not on the free list.", "gauge",
         stats.blocks_used),
        ("tokenmill_kv_blocks_free", "KV cache blocks on the free list.", "gauge",
         stats.blocks_free),
        ("tokenmill_kv_blocks_held_by_requests",
         "KV cache blocks with a reference count above zero.", "gauge", stats.blocks_held),
        ("tokenmill_prefix_cache_hit_rate",
         "Prefix-cache block lookups that found the block, over all lookups.", "gauge",
         stats.prefix_cache_hit_rate),
        ("tokenmill_prompt_tokens_total", "Prompt tokens of all sequences added.", "counter",
         stats.prompt_tokens),
        ("tokenmill_generation_tokens_total", "Tokens generated.", "counter",
         stats.generation_tokens),
        ("tokenmill_kv_cache_bytes_per_token",
         "Bytes one token's K and V take in the KV cache, over all layers.", "gauge",
         stats.kv_bytes_per_token),
        ("tokenmill_prefix_cache_disk_hit_tokens_total",
         "Prompt tokens whose KV blocks were read back from the prefix cache on disk.",
         "counter", stats.prefix_cache_disk_hit_tokens),
        ("tokenmill_prefix_cache_disk_blocks",
         "KV blocks the prefix cache on disk holds.", "gauge", stats.prefix_cache_disk_blocks),
    ]  # fmt: skip
    samples: list[Sample] = [(*sample, {}) for sample in plain]
    spec = stats.speculative
    if spec:
        method = {"method": str(spec["speculative_method"])}
        samples += [
            ("tokenmill_spec_decode_num_drafts_total",
             "Speculative verification steps (a sequence's guesses scored in one pass).",
             "counter", spec["speculative_steps"], method),
            ("tokenmill_spec_decode_num_draft_tokens_total",
             "Speculative tokens proposed and verified.", "counter",
             spec["speculative_proposed_tokens"], method),
            ("tokenmill_spec_decode_num_accepted_tokens_total",
             "Speculative tokens accepted (each one a token that cost no step of its own).",
             "counter", spec["speculative_accepted_tokens"], method),
            ("tokenmill_spec_decode_draft_acceptance_rate",
             "Accepted over proposed speculative tokens (0 before any was proposed).",
             "gauge", spec["speculative_acceptance_rate"], method),
        ]  # fmt: skip
    return samples


def _label(value: str) -> str:
    """A label value escaped for the exposition format (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    """{k="v",...} for a sample's labels, escaped; "" for none."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items()) + "}"


@dataclass(frozen=True)
class ModelSeries:
    """One served model's state for a several-model /metrics page (server/model_pool.py).
    metrics and stats: its engine's, None while it is not loaded."""

    name: str
    loaded: bool
    loads: int
    evictions: int
    metrics: ServerMetrics | None = None
    stats: EngineStats | None = None


def render_models(http: HTTPRequests, models: list[ModelSeries]) -> str:
    """The /metrics page of a server with several models: the HTTP counters once, for the
    server; every per-engine series once per loaded model, labelled model="NAME" (each
    metric's HELP and TYPE once, as the format requires); and the pool's own series for
    every served model, loaded or not. An evicted model's series go with it, and come
    back from zero when it loads again (a counter reset, as after a restart)."""
    loaded = [m for m in models if m.metrics is not None and m.stats is not None]
    parts = []
    # each metric's samples together under one header, in the order they first appear
    # (a model's engine may report series another lacks: speculation's, while it is off)
    grouped: dict[str, tuple[str, str, list[str]]] = {}
    for m in loaded:
        for name, help_text, kind, value, labels in engine_samples(m.stats):
            entry = grouped.setdefault(name, (help_text, kind, []))
            entry[2].append(f"{name}{_labels({'model': m.name, **labels})} {_number(value)}")
    for name, (help_text, kind, samples) in grouped.items():
        parts.append("\n".join([*_header(name, help_text, kind), *samples]))
    parts.append(http.render())
    pool = [
        ("tokenmill_model_loaded", "1 while the model is loaded, else 0.", "gauge",
         lambda m: int(m.loaded)),
        ("tokenmill_model_loads_total", "Times the model was loaded.", "counter",
         lambda m: m.loads),
        ("tokenmill_model_evictions_total",
         "Times the model was evicted to make room for another.", "counter",
         lambda m: m.evictions),
    ]  # fmt: skip
    for name, help_text, kind, value in pool:
        lines = _header(name, help_text, kind)
        lines += [f'{name}{{model="{_label(m.name)}"}} {value(m)}' for m in models]
        parts.append("\n".join(lines))
    if loaded:
        info = "tokenmill_build_info"
        lines = _header(info, "What this server runs: version, kernels, weights.", "gauge")
        for m in loaded:
            # the model label is the served name, as on every series; file: the weights'
            labels = {**m.metrics.info, "model": m.name, "file": m.metrics.info.get("model", "")}
            quoted = ",".join(f'{k}="{_label(str(v))}"' for k, v in labels.items())
            lines.append(f"{info}{{{quoted}}} 1")
        parts.append("\n".join(lines))
        for i, histogram in enumerate(loaded[0].metrics.histograms()):
            lines = _header(histogram.name, histogram.help_text, "histogram")
            for m in loaded:
                lines += m.metrics.histograms()[i].samples(f'model="{_label(m.name)}",')
            parts.append("\n".join(lines))
    return "\n".join(parts) + "\n"
