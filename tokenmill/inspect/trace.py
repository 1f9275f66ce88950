"""Opt-in recording of one request's trip through the engine, step by step.

A `Trace` passed to `LLMEngine.add_request(..., trace=...)` receives the engine's
trace hooks for that request only, and turns what it sees into plain JSON-able
data: the tokens, embedding and position samples, per layer the Q/K/V shapes and
attention summaries (and an MoE layer's router choice per token: which experts, with
what weight), attention maps (weights) for the layers and heads asked for, the
KV cache size, the sampler's distributions at every stage, the chosen token and timings.
Under speculative decoding a traced request speculates like any other: a verification
step (phase "verify") records the guesses, each emitted token's sample with the target's
probability of its guess there, how many were accepted, the K/V rows rolled back, and the
step's time beside this trace's plain decode steps.
`tokenmill inspect` prints it, and `POST /v1/inspect` streams it to the web page.

What a trace costs is bounded, whatever the prompt's length (a
5,800-token prompt once built every layer's full [H, L, C] attention matrix per chunk):
- the per-layer summaries of a prefill chunk come from its last SUMMARY_ROWS query rows
  (a decode step has one row), so they cost O(SUMMARY_ROWS x C) per layer, not O(L x C);
- attention maps are kept only for `layers` x `heads`, and of the prompt only its last
  rows, as many as PROMPT_MAP_CELLS allows (`prompt_map_rows`); only those rows' weights
  are computed. Every decode step adds one row per map.
`size_bound` gives the largest JSON a trace of a request can make, so the server can
refuse an oversized one before it runs.

Only the traced request's rows are recorded, and only small samples are kept. The
hooks need each layer's tensors, so a step with a traced row runs the torch path
(models/paths.py) for every row in it: the other requests of that step lose the native
decode paths for as long as the trace runs (see benchmarks/trace_overhead.py). A traced
prompt is chunked like any other (engine/scheduler.py), so other requests' decode steps
run between its chunks.

The contract (engine/hooks.py): `Trace` implements StepHooks, in the order given there,
and reads the engine only through the read-only EngineView it gets at each step's end.
The records it makes are the JSON that `tokenmill inspect` and the web page read
(inspect/schema.py declares them).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tokenmill.engine.hooks import EngineView
from tokenmill.engine.scheduler import is_decode
from tokenmill.engine.sequence import Status
from tokenmill.inspect.schema import ModelRecord, PromptRecord, StepRecord, TraceRecord
from tokenmill.layers.attention import AttentionSite
from tokenmill.models.positions import rounded as _round
from tokenmill.sampling import SamplingState, process_logits
from tokenmill.tokenizer import IncrementalDetokenizer

StepListener = Callable[["Trace", dict[str, Any]], None]

MAX_SAMPLE_ROWS = 512  # embedding / position samples are kept for at most this many tokens
SUMMARY_ROWS = 16  # a prefill chunk's per-layer summaries come from its last this many rows
PROMPT_MAP_CELLS = 250_000  # attention map weights kept of the prompt (maps x heads x rows x
# keys): a long prompt keeps its last rows only, so its maps stay O(this), not O(T^2)


def _round_weights(weights: Tensor) -> list:
    """Attention weights (finite, in [0, 1]) as nested lists rounded to 4 decimals, in
    one tensor op: rounded in float64, each value is the double nearest its 4-decimal
    form, so it prints as at most 6 characters ("0.1234"), and no Python loop runs per
    cell (a map holds up to PROMPT_MAP_CELLS of them)."""
    return weights.detach().cpu().double().round(decimals=4).tolist()


def prompt_map_rows(prompt_len: int, maps: int) -> int:
    """How many of the prompt's last query rows the attention maps keep: as many as
    PROMPT_MAP_CELLS allows for `maps` (kept layers x kept heads) maps of rows
    `prompt_len` keys wide, at least the last one (it chose the first token); 0 when no
    map is asked for."""
    if maps <= 0 or prompt_len <= 0:
        return 0
    return max(1, min(prompt_len, PROMPT_MAP_CELLS // (maps * prompt_len)))


# Upper bounds for size_bound, in bytes of compact JSON (separators "," and ":"):
WEIGHT_BYTES = 7  # a weight rounded to 4 decimals ("0.1234", "1.0", "0.0") and its comma
NUMBER_BYTES = 12  # any other rounded number or id, with its comma
PIECE_BYTES = 96  # a token's piece or text, quoted (most vocabularies' longest are shorter;
# SmolLM2's longest piece is 164 bytes, Gemma 3's 64)
CANDIDATE_BYTES = 200  # one candidate's keys and numbers, besides its piece and text
LAYER_BYTES = 300  # one layer record's keys, shapes and norms, besides its per-head lists
HEAD_BYTES = 21  # a head's entropy ("12.345,"), peak weight ("0.123,") and argmax key
STEP_BYTES = 1_400  # one step's keys, kv, timings, sample scalars, event framing
ROUTER_BYTES = 40  # an MoE layer's router record's keys and brackets, besides its rows
HEADER_BYTES = 4_000  # the model record, trace settings and the summary's scalars


def size_bound(
    cfg,
    prompt_len: int,
    max_tokens: int,
    *,
    map_layers: int,
    map_heads: int,
    top_n: int,
    chunk_tokens: int,
    sample_dims: int = 8,
    speculative_k: int = 0,
) -> int:
    """The most bytes of compact JSON a trace of this request can make (its header, every
    step, the summary): what POST /v1/inspect checks against its cap before running.

    cfg: the model's ModelConfig; map_layers x map_heads: the attention maps asked for;
    chunk_tokens: the scheduler's per-step token budget (a prompt is prefilled in chunks
    of at most this). The maps are bounded exactly (prompt_map_rows rows of the prompt, one
    row per decode step, each as wide as its context); the rest per token, layer and
    candidate, with a token's text taken as PIECE_BYTES (a request whose tokens are longer
    than that can still pass; the route counts the real bytes as well). A preempted
    request recomputes its prefill and may record more. speculative_k: the engine's most
    guesses per step (0: no speculation); a verification step runs 1 + k rows, each of them
    summarised and mapped like a decode row, and records its guesses.
    """
    maps = map_layers * map_heads
    decode_steps = max_tokens - 1
    steps = -(-prompt_len // max(1, chunk_tokens)) + decode_steps
    # a decode step's rows: 1, or a verification's 1 + k (its guesses' rows included)
    step_rows = 1 + speculative_k
    rows = min(prompt_len, MAX_SAMPLE_ROWS * steps) + decode_steps * step_rows  # per-row samples
    per_row = 3 * NUMBER_BYTES + PIECE_BYTES + (4 * sample_dims + 1) * NUMBER_BYTES
    layers = cfg.num_layers * (LAYER_BYTES + cfg.num_heads * HEAD_BYTES)
    sample = (top_n + 1) * (CANDIDATE_BYTES + 2 * PIECE_BYTES) + (top_n + 8) * NUMBER_BYTES
    sample += 3 * PIECE_BYTES  # the chosen token's piece, text and released text
    prompt = prompt_len * (NUMBER_BYTES + 3 * PIECE_BYTES)  # ids, pieces, texts, text
    # the maps: rows of the prompt's last chunk are prompt_len keys wide; decode step t
    # (1..decode_steps) reads prompt_len + t keys
    map_rows = prompt_map_rows(prompt_len, maps)
    cells = maps * (map_rows * prompt_len + decode_steps * step_rows * prompt_len)
    if speculative_k:  # a row past the prompt reads at most max_tokens + k more keys
        cells += maps * decode_steps * step_rows * (max_tokens + speculative_k)
    else:
        cells += maps * decode_steps * (decode_steps + 1) // 2
    extra = decode_steps * step_rows  # map rows after the prompt's
    map_overhead = map_layers * (steps * 200 + (map_rows + extra) * (NUMBER_BYTES + 2))
    map_overhead += maps * (map_rows + extra) * 2  # each row's brackets
    # a verification's record: per guess its id, piece, row record; per step its scalars
    speculation = decode_steps * (speculative_k * (4 * NUMBER_BYTES + PIECE_BYTES + 60) + 300)
    speculation = speculation if speculative_k else 0
    # MoE layers: per kept row its k expert ids and weights, each list's brackets
    sparse = sum(cfg.moe_layers) if cfg.num_experts else 0
    k = cfg.num_experts_per_tok
    router = sparse * (steps * ROUTER_BYTES + rows * (k * (NUMBER_BYTES + WEIGHT_BYTES) + 6))
    return (
        HEADER_BYTES
        + prompt
        + router
        + steps * (STEP_BYTES + layers)
        + max_tokens * sample
        + rows * per_row
        + cells * WEIGHT_BYTES
        + map_overhead
        + speculation
    )


def _attention_weights(
    q: Tensor, keys: Tensor, mask: Tensor | None, scale: float, first_query: int
) -> Tensor:
    """softmax(q kᵀ · scale) for one sequence, in float32.

    q: [H, L, hd]; keys: [Hkv, C, hd]; mask: [L, C] bool (True = may attend) or
    None for plain causal attention where query row i sits at key position
    first_query + i. GQA: query head h reads K/V head h // (H // Hkv).
    Returns [H, L, C]; every row sums to 1.
    """
    heads, length, hd = q.shape
    kv_heads, context = keys.shape[0], keys.shape[1]
    # GQA without copying K: the query heads sharing a K/V head become rows of one
    # product, [Hkv, rep * L, hd] x [Hkv, hd, C] -> [Hkv, rep * L, C] = [H, L, C].
    grouped = q.float().reshape(kv_heads, (heads // kv_heads) * length, hd)
    scores = torch.matmul(grouped, keys.float().transpose(1, 2)).view(heads, length, context)
    scores *= scale
    if mask is None:
        rows = torch.arange(length, device=q.device)[:, None] + first_query
        mask = torch.arange(context, device=q.device)[None, :] <= rows
    return scores.masked_fill_(~mask, float("-inf")).softmax(-1)


def _timed(hook: Callable) -> Callable:
    """Count a hook's own run time, so step timings can leave tracing out."""

    @functools.wraps(hook)
    def timed(self: Trace, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            hook(self, *args)
        finally:
            self._hook_s += time.perf_counter() - t0

    return timed


def _entropy(probs: Tensor) -> Tensor:
    """Shannon entropy in bits along the last dim (0 · log 0 counts as 0)."""
    return torch.special.entr(probs).sum(-1) / math.log(2)


class Trace:
    """Records one request's pipeline; pass it as `add_request(..., trace=Trace())`.

    layers, heads: whose attention maps (weights) to keep: every step keeps one map per
    layer in `layers`, of the heads in `heads` (None: every head), with the rows of the
    prompt's end (prompt_map_rows) and every decode step's row. No layers (the default):
    no maps, only the per-layer summaries, the cheapest trace.
    top_n: how many candidate tokens to keep per sampled token.
    sample_dims: how many leading numbers of each vector to keep as a sample.
    on_step: called as on_step(trace, step) when a step's record is complete
    (from the engine's thread), e.g. to print it or stream it.
    keep_steps: keep every step's record in `steps` (for to_dict); False keeps only what
    the summary needs, so a streamed trace holds one step at a time.
    """

    def __init__(
        self,
        layers: Iterable[int] = (),
        heads: Iterable[int] | None = None,
        top_n: int = 10,
        sample_dims: int = 8,
        on_step: StepListener | None = None,
        keep_steps: bool = True,
    ):
        layers = sorted(set(layers))
        heads = None if heads is None else sorted(set(heads))
        if any(i < 0 for i in layers) or any(h < 0 for h in heads or ()):
            raise ValueError("layers and heads must be >= 0")
        if top_n < 1 or sample_dims < 1:
            raise ValueError("top_n and sample_dims must be >= 1")
        self.layers, self.heads, self.top_n, self.sample_dims = layers, heads, top_n, sample_dims
        self.on_step, self.keep_steps = on_step, keep_steps
        self.model: ModelRecord | dict = {}
        self.prompt: PromptRecord | dict = {}
        self.steps: list[StepRecord] = []
        self.summary: dict[str, Any] = {}
        self.map_from: int | None = None  # first prompt position whose map rows are kept
        self._prompt_len = 0  # the traced request's, set as its first step begins
        # per finished step: (step_ms, trace_ms, tokens it emitted, their text, verification?)
        self._timeline: list[tuple[float, float, list[int], str, bool]] = []
        self._step: StepRecord | None = None
        self._proposal: tuple[int, ...] = ()  # the current step's guesses (verification)
        self._samples: list[dict[str, Any]] = []  # the current step's, one per token emitted
        self._started = 0.0
        self._hook_s = 0.0  # time spent inside this step's hooks
        self._last_row: Tensor | None = None  # the residual stream before the current sublayer
        self._detok: IncrementalDetokenizer | None = None

    # ------------------------------------------------------------------ engine hooks
    def on_step_begin(self, seq, num_tokens: int, proposal: tuple[int, ...] = ()) -> None:
        start = seq.num_computed
        decode = is_decode(seq, num_tokens)  # the scheduler's rule, as the model runner packs
        self._started, self._hook_s = time.perf_counter(), 0.0
        self._prompt_len = len(seq.prompt_ids)
        self._proposal = tuple(proposal)
        # a verification's rows: the sequence's last token, then its guesses
        own = num_tokens - len(proposal)
        self._step = {
            "index": len(self._timeline),
            "phase": "verify" if proposal else "decode" if decode else "prefill",
            "start": start,
            "num_tokens": num_tokens,
            "input_ids": [seq.token_at(p) for p in range(start, start + own)] + list(proposal),
            "layers": [],
            "blocks_held": len(seq.block_table),  # the scheduler grew the table already
        }

    @_timed
    def on_embedding(self, meta, input_ids: Tensor, x: Tensor) -> None:
        rows = x[meta.trace.rows]  # [n, d]
        self._step["positions"] = meta.positions[meta.trace.rows].tolist()
        self._step["embedding"] = {
            "shape": list(rows.shape),
            "sample": _round(rows[:MAX_SAMPLE_ROWS, : self.sample_dims]),
            "norms": _round(rows[:MAX_SAMPLE_ROWS].float().norm(dim=-1), 3),
        }
        self._last_row = rows[-1].float().clone()

    @_timed
    def on_attention(
        self,
        meta,
        site: AttentionSite,
        layer_idx: int,
        q: Tensor,
        keys: Tensor,
        mask: Tensor | None,
        scale: float,
    ) -> None:
        kind, index = meta.trace.site.kind, meta.trace.site.index
        if site.kind != kind or (kind == "prefill" and site.index != index):
            return  # an attention call of other requests in the batch
        if kind == "decode":
            context = int(meta.decode_context_lens[index])
            q_seq, k_seq = q[index], keys[index, :, :context]  # [H, 1, hd], [Hkv, C, hd]
            m = mask[index, 0, :, :context]  # [1, C]
        else:
            q_seq, k_seq, m = q[0], keys[0], mask  # [H, L, hd], [Hkv, C, hd], [L, C] | None
        heads, length, _ = q_seq.shape
        context = k_seq.shape[1]
        first = context - length  # the position of the chunk's first query row
        if self.map_from is None:
            if self.heads and self.heads[-1] >= heads:
                raise ValueError(f"heads must be < {heads} (the model's), got {self.heads}")
            kept_heads = heads if self.heads is None else len(self.heads)
            maps = len(self.layers) * kept_heads
            self.map_from = self._prompt_len - prompt_map_rows(self._prompt_len, maps)
        # Only the rows needed are computed, always a suffix of the chunk: the last
        # SUMMARY_ROWS for the summaries, and for a map layer its rows at map_from or later.
        map_rows = max(0, context - max(first, self.map_from)) if layer_idx in self.layers else 0
        n = min(length, max(SUMMARY_ROWS, map_rows))
        rows_mask = None if m is None else m[length - n :]
        weights = _attention_weights(q_seq[:, length - n :], k_seq, rows_mask, scale, context - n)
        summarised = weights[:, -min(n, SUMMARY_ROWS) :]  # [H, S, C]
        self._step["layers"].append(
            {
                "layer": layer_idx,
                "q": [length, heads, q_seq.shape[-1]],
                "k": [context, k_seq.shape[0], k_seq.shape[-1]],
                "v": [context, k_seq.shape[0], k_seq.shape[-1]],
                "summary_rows": summarised.shape[1],
                "entropy": _round(_entropy(summarised).mean(-1), 3),  # [H] bits, row mean
                "max": _round(summarised.amax(-1).mean(-1), 3),  # [H] mean of each row's peak
                "argmax": weights[:, -1].argmax(-1).tolist(),  # [H] the newest row's
            }
        )
        if map_rows > 0:
            picked = weights[:, n - map_rows :]  # [H, map_rows, C]
            if self.heads is not None:
                picked = picked[self.heads]
            self._step.setdefault("attention", []).append(
                {
                    "layer": layer_idx,
                    "heads": list(range(heads)) if self.heads is None else self.heads,
                    "query_positions": list(range(context - map_rows, context)),
                    "context": context,
                    "weights": _round_weights(picked),  # [heads][rows][C]
                }
            )

    @_timed
    def on_residual(self, meta, layer_idx: int, sublayer: str, x: Tensor) -> None:
        row = x[meta.trace.rows][-1].float()
        update = row - self._last_row
        self._last_row = row.clone()
        layer = self._step["layers"][-1]  # on_attention of this layer came just before
        layer[f"{sublayer}_update_norm"] = round(float(update.norm()), 3)
        layer[f"{sublayer}_residual_norm"] = round(float(row.norm()), 3)

    @_timed
    def on_router(self, meta, layer_idx: int, ids: Tensor, weights: Tensor) -> None:
        # ids, weights: [T, k] for the whole batch; kept: the traced request's rows, the
        # first MAX_SAMPLE_ROWS of them as for the embedding sample
        layer = self._step["layers"][-1]  # on_attention of this layer came just before
        rows = meta.trace.rows
        layer["experts"] = {
            "ids": ids[rows][:MAX_SAMPLE_ROWS].tolist(),  # [n][k] best first
            "weights": _round(weights[rows][:MAX_SAMPLE_ROWS]),  # [n][k], 4 decimals
        }

    @_timed
    def on_sample(self, logits_row: Tensor, state: SamplingState, token_id: int) -> None:
        t = process_logits(logits_row, state)
        # Ranked before the grammar mask, so the candidates show what it took away.
        order = t.logits.topk(min(self.top_n, t.logits.shape[0])).indices.tolist()
        if token_id not in order:
            order.append(token_id)
        allowed = t.allowed if t.allowed is not None else torch.ones_like(t.keep)
        candidates = [
            {
                "id": i,
                "logit": round(float(t.raw_logits[i]), 4),
                "prob": round(float(t.probs[i]), 6),
                "scaled_prob": round(float(t.scaled_probs[i]), 6),
                "final_prob": round(float(t.final_probs[i]), 6),
                "kept": bool(t.keep[i] and allowed[i]),
                "allowed": bool(allowed[i]),
            }
            for i in order
        ]
        p = state.params
        sample = {
            "token": token_id,
            "prob": round(float(t.final_probs[token_id]), 6),
            "prob_before_temperature": round(float(t.probs[token_id]), 6),
            "rank": int((t.logits > t.logits[token_id]).sum()) + 1,
            "vocab": int(t.raw_logits.shape[0]),
            "params": {
                "temperature": p.temperature,
                "top_k": p.top_k,
                "top_p": p.top_p,
                "min_p": p.min_p,
                "greedy": p.greedy,
            },
            "entropy": round(float(_entropy(t.probs)), 3),
            "entropy_after_temperature": round(float(_entropy(t.scaled_probs)), 3),
            "survivors": {  # after the grammar mask too
                "top_k": int((t.keep_top_k & allowed).sum()),
                "top_p": int((t.keep_top_p & allowed).sum()),
                "min_p": int((t.keep & allowed).sum()),
            },
            "final_sum": round(float(t.final_probs.sum()), 6),
            "candidates": candidates,
        }
        if t.allowed is not None:
            sample["grammar"] = self._grammar(t, state, order, candidates)
        j = len(self._samples)  # a verification's row j follows guess j - 1
        if j < len(self._proposal):  # the guess this row's token is checked against
            guess = self._proposal[j]
            sample["guess"] = guess
            sample["guess_prob"] = round(float(t.final_probs[guess]), 6)
            sample["guess_accepted"] = guess == token_id
        self._samples.append(sample)

    @staticmethod
    def _grammar(t, state: SamplingState, order: list[int], candidates: list[dict]) -> dict:
        """The constraint at this step: how much of the vocabulary it allowed, and which
        of the model's top candidates it masked out (with their unconstrained odds)."""
        unconstrained = t.logits.softmax(-1)
        for c in candidates:
            c["unconstrained_prob"] = round(float(unconstrained[c["id"]]), 6)
        masked = [i for i in order if not t.allowed[i]]
        return {
            "kind": state.grammar.kind,
            "allowed": int(t.allowed.sum()),
            "vocab": int(t.allowed.shape[0]),
            "masked": masked,  # candidate ids, best first
            "masked_mass": round(float(unconstrained[~t.allowed].sum()), 6),
        }

    def on_step_end(self, seq, engine: EngineView) -> None:
        now = time.perf_counter()
        step, self._step = self._step, None
        step["step_ms"] = round((now - self._started - self._hook_s) * 1000, 3)
        step["trace_ms"] = round(self._hook_s * 1000, 3)
        step["since_arrival_ms"] = round((now - seq.arrival) * 1000, 3)
        if not self.model:
            self._describe(engine, seq)
        tok = engine.tokenizer
        step["input_pieces"] = [tok.id_to_piece(i) for i in step["input_ids"]]
        if "positions" in step:
            # models/positions.py's position_sample, bound to the engine's model
            step["position_encoding"] = engine.position_encoding(
                step["positions"][:MAX_SAMPLE_ROWS], self.sample_dims
            )
        samples, self._samples = self._samples, []
        for sample in samples:  # in order: each one's text follows the one before
            self._finish_sample(sample, seq, engine)
        if samples:
            step["sample"] = samples[-1]
        if self._proposal:
            step["samples"] = samples
            step["speculation"] = self._speculation(samples, step, engine)
        step["kv"] = self._kv(step, seq, engine)
        self._last_row = None
        self._timeline.append(
            (
                step["step_ms"],
                step["trace_ms"],
                [sample["token"] for sample in samples],
                "".join(sample["text"] for sample in samples),
                bool(self._proposal),
            )
        )
        if self.keep_steps:
            self.steps.append(step)
        self._summarise(seq)
        if self.on_step is not None:
            self.on_step(self, step)

    # ------------------------------------------------------------------ step end helpers
    def _describe(self, engine: EngineView, seq) -> None:
        c, tok = engine.config, engine.tokenizer
        path = engine.decode_path
        self.model = {
            "name": engine.model_name,
            "arch": c.arch,
            "num_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "position": c.position,
            "rope_theta": c.rope.theta if c.position == "rope" else None,
            "mlp": c.mlp,
            "activation": c.activation,
            "norm": c.norm,
            "tie_embeddings": c.tie_embeddings,
            "num_experts": c.num_experts,
            "experts_per_token": c.num_experts_per_tok,
            "dtype": engine.info["dtype"],
            "weights": engine.info["weights"],
            "kernels": engine.info["kernels"],
            "prefill": engine.info["prefill"],
            # what an untraced decode step would run (a traced one runs the torch path)
            "decode_path": path.name,
            "decode_path_reason": path.reason,
            # a parallel run: what each rank holds (the trace records rank 0's part)
            "parallel": engine.parallel,
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "block_size": engine.block_size,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "kv_capacity_bytes": engine.kv_capacity_bytes,
        }
        ids = list(seq.prompt_ids)
        self.prompt = {
            "ids": ids,
            "pieces": [tok.id_to_piece(i) for i in ids],
            "texts": [tok.decode([i]) for i in ids],
            "text": tok.decode(ids),
        }
        self._detok = IncrementalDetokenizer(tok, prompt_ids=ids)

    def _finish_sample(self, sample: dict[str, Any], seq, engine: EngineView) -> None:
        tok = engine.tokenizer
        for c in sample["candidates"]:
            c["piece"], c["text"] = tok.id_to_piece(c["id"]), tok.decode([c["id"]])
        token = sample["token"]
        sample["piece"], sample["token_text"] = tok.id_to_piece(token), tok.decode([token])
        ends = engine.is_stop_token(token, seq.params)  # the engine's own rule
        sample["is_stop"] = ends
        sample["text"] = "" if ends else self._detok.add(token)  # a stop token is never shown

    def _speculation(
        self, samples: list[dict[str, Any]], step: dict[str, Any], engine: EngineView
    ) -> dict[str, Any]:
        """A verification step's guesses and what became of them, and its time beside the
        plain decode steps this trace has seen (both run the traced torch path)."""
        proposal, tok = self._proposal, engine.tokenizer
        stats = engine.speculative_stats()
        accepted = 0
        for sample in samples:  # the engine's rule: the longest agreeing prefix
            if not sample.get("guess_accepted"):
                break
            accepted += 1
        plain = sorted(t[0] for t in self._timeline[1:] if len(t[2]) == 1 and not t[4])
        plain_ms = plain[len(plain) // 2] if plain else None  # the median so far
        return {
            "method": stats.get("speculative_method", ""),
            "proposed": list(proposal),
            "proposed_pieces": [tok.id_to_piece(i) for i in proposal],
            "proposed_texts": [tok.decode([i]) for i in proposal],
            "accepted": accepted,
            "emitted": len(samples),
            "rolled_back": len(proposal) - accepted,
            "plain_step_ms": plain_ms,
            "step_vs_plain": round(step["step_ms"] / plain_ms, 3) if plain_ms else None,
            # the fused decode stack's own figure (untraced steps): a verification's time
            # over a plain decode step's, the speculator's moving averages
            "engine_verify_cost": stats.get("speculative_verify_cost") or None,
        }

    def _kv(self, step: dict[str, Any], seq, engine: EngineView) -> dict[str, Any]:
        """The request's KV cache after this step.

        Taken from the step itself (start + num_tokens tokens have K/V now) because a
        sequence that finished in this step has already handed its blocks back.
        """
        rolled_back = step.get("speculation", {}).get("rolled_back", 0)
        tokens = step["start"] + step["num_tokens"] - rolled_back
        return {
            "tokens": tokens,
            "bytes": tokens * engine.kv_bytes_per_token,
            "written": step["num_tokens"],
            "rolled_back": rolled_back,  # a verification's rejected guesses' rows, given back
            "blocks": step.pop("blocks_held"),
            "released": seq.status is Status.FINISHED,
            "pool_blocks_used": engine.pool_blocks_used(),
            "pool_blocks_total": engine.pool_blocks_total,
        }

    def _summarise(self, seq) -> None:
        timeline = self._timeline
        first = next((i for i, t in enumerate(timeline) if t[2]), None)
        end = len(timeline) if first is None else first + 1
        prefill_ms = sum(t[0] for t in timeline[:end])
        decode = timeline[first + 1 :] if first is not None else []
        decode_ms = [t[0] for t in decode]
        decode_tokens = sum(len(t[2]) for t in decode)  # a verification emits 1 to 1 + k
        ttft = None
        if seq.first_token_time is not None:  # the engine's clock, less the tracer's own time
            traced_s = sum(t[1] for t in timeline[:end]) / 1000
            ttft = seq.first_token_time - seq.arrival - traced_s
        verifications = [t for t in timeline if t[4]]
        self.summary = {
            "output_ids": [i for t in timeline for i in t[2]],
            "text": "".join(t[3] for t in timeline),
            "prefill_ms": round(prefill_ms, 3),
            "decode_ms": decode_ms,
            "decode_tokens": [len(t[2]) for t in decode],  # per decode step: 1, or a verification's
            "time_to_first_token_ms": round(ttft * 1000, 3) if ttft is not None else None,
            "decode_tokens_per_s": round(decode_tokens / sum(decode_ms) * 1000, 2)
            if decode_ms
            else None,
            "finish_reason": seq.finish_reason,
            # speculative decoding: verification steps, and the tokens they emitted
            "verify_steps": len(verifications),
            "verify_tokens": sum(len(t[2]) for t in verifications),
        }

    def live_summary(self) -> dict[str, Any]:
        """The summary's scalars, without its per-token lists (output_ids, text,
        decode_ms): what a streamed step carries, so each step's event stays the same size
        however long the answer."""
        return {k: v for k, v in self.summary.items() if k not in SUMMARY_LISTS}

    # ------------------------------------------------------------------ export
    def header(self) -> dict[str, Any]:
        """What the steps refer to: the model's shape, the prompt, the trace settings
        (filled in when the first step ends)."""
        return {
            "model": self.model,
            "prompt": self.prompt,
            "trace": {
                "layers": self.layers,
                "heads": self.heads,
                "top_n": self.top_n,
                "summary_rows": SUMMARY_ROWS,
                "map_from": self.map_from,
            },
        }

    def to_dict(self) -> TraceRecord:
        """Everything recorded, as JSON-able data (inspect/schema.py); `steps` is empty for
        a trace made with keep_steps=False."""
        return {**self.header(), "steps": self.steps, "summary": self.summary}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(dumps(self.to_dict()), encoding="utf-8")


SUMMARY_LISTS = ("output_ids", "text", "decode_ms", "decode_tokens")


def dumps(record: Any) -> str:
    """A trace record as compact JSON (what size_bound counts): no spaces, UTF-8 text kept
    as is."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)
