"""Opt-in recording of one request's trip through the engine, step by step.

A `Trace` passed to `LLMEngine.add_request(..., trace=...)` receives the engine's
trace hooks for that request only, and turns what it sees into plain JSON-able
data: the tokens, embedding and position samples, per layer the Q/K/V shapes and
attention summaries (with the full weights for one chosen layer), the KV cache
size, the sampler's distributions at every stage, the chosen token and timings.
`tokenmill inspect` prints it, and `POST /v1/inspect` streams it to the web page.

Only the traced request's rows are recorded, and only small samples are kept. The
hooks need each layer's tensors, so a step with a traced row runs the torch path
(models/paths.py) for every row in it: the other requests of that step lose the native
decode paths for as long as the trace runs (see benchmarks/trace_overhead.py).

The contract (engine/hooks.py): `Trace` implements StepHooks, in the order given there,
and reads the engine only through the read-only EngineView it gets at each step's end.
The records it makes are the JSON that `tokenmill inspect` and the web page read
(trace_schema.py declares them).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tokenmill.engine.hooks import AttentionSite, EngineView
from tokenmill.engine.scheduler import is_decode
from tokenmill.engine.sequence import Status
from tokenmill.sampling import SamplingState, process_logits
from tokenmill.tokenizer import IncrementalDetokenizer
from tokenmill.trace_schema import ModelRecord, PromptRecord, StepRecord, TraceRecord

StepListener = Callable[["Trace", dict[str, Any]], None]

MAX_SAMPLE_ROWS = 512  # embedding / position samples are kept for at most this many tokens
MAX_ATTENTION_CELLS = 250_000  # weights kept per step (heads x rows x keys): a long prompt
# keeps only its last rows, so a trace stays small enough to stream as JSON


def _round(values: Tensor | list[float], digits: int = 4) -> list:
    """A tensor (any rank) as nested lists of rounded floats: compact JSON."""
    if isinstance(values, Tensor):
        values = values.detach().float().cpu().tolist()
    if isinstance(values, list):
        return [_round(v, digits) for v in values]
    return round(values, digits) if math.isfinite(values) else None


def _attention_weights(
    q: Tensor, keys: Tensor, mask: Tensor | None, scale: float, first_query: int
) -> Tensor:
    """softmax(q kᵀ · scale) for one sequence, in float32.

    q: [H, L, hd]; keys: [Hkv, C, hd]; mask: [L, C] bool (True = may attend) or
    None for plain causal attention where query row i sits at key position
    first_query + i. GQA: query head h reads K/V head h // (H // Hkv).
    Returns [H, L, C]; every row sums to 1.
    """
    heads, length, _ = q.shape
    keys = keys.float().repeat_interleave(heads // keys.shape[0], dim=0)  # [H, C, hd]
    scores = torch.matmul(q.float(), keys.transpose(1, 2)) * scale  # [H, L, C]
    if mask is None:
        rows = torch.arange(length, device=q.device)[:, None] + first_query
        mask = torch.arange(keys.shape[1], device=q.device)[None, :] <= rows
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


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
    logs = torch.where(probs > 0, probs.log2(), torch.zeros_like(probs))
    return -(probs * logs).sum(-1)


def position_sample(model, positions: list[int], sample_dims: int) -> dict[str, Any]:
    """How position enters, for the first positions: RoPE rotation angles, or the learned
    vector added (the engine hands traces this through EngineView.position_encoding)."""
    shown = positions[:MAX_SAMPLE_ROWS]
    if model.pos_embed is not None:
        rows = model.pos_embed.weight[shown, :sample_dims]
        return {"kind": "learned", "sample": _round(rows)}
    rotary = model.rotary
    half = rotary.dim // 2
    pairs = min(sample_dims, half)
    # Rotate unit vectors through the model's own RoPE: e_i at position p comes out as
    # cos(p·θ_i) in dim i and sin(p·θ_i) in dim i + dim/2 (rotate-half layout).
    pos = torch.tensor([1, *shown], device=rotary.cos.device)
    units = torch.zeros(len(pos), pairs, model.cfg.head_dim, device=pos.device)
    units[:, range(pairs), range(pairs)] = 1.0
    out, _ = rotary(units, units[:, :1], pos)
    cos, sin = (
        out[:, range(pairs), range(pairs)],
        out[:, range(pairs), range(half, half + pairs)],
    )
    inv_freq = torch.atan2(sin[0], cos[0])  # θ_i < π, so position 1 gives it exactly
    return {
        "kind": "rope",
        "rotary_dims": rotary.dim,
        "inv_freq": _round(inv_freq, 6),
        "angles": _round(torch.outer(pos[1:].float(), inv_freq), 4),
        "cos": _round(cos[1:]),
        "sin": _round(sin[1:]),
    }


class Trace:
    """Records one request's pipeline; pass it as `add_request(..., trace=Trace())`.

    layer, head: whose full attention weights to keep (prefill: the [L, C] matrix;
    decode: one row per step). head=None keeps every head of that layer.
    top_n: how many candidate tokens to keep per sampled token.
    sample_dims: how many leading numbers of each vector to keep as a sample.
    on_step: called as on_step(trace, step) when a step's record is complete
    (from the engine's thread), e.g. to print it or stream it.
    """

    def __init__(
        self,
        layer: int = 0,
        head: int | None = 0,
        top_n: int = 10,
        sample_dims: int = 8,
        on_step: StepListener | None = None,
    ):
        if layer < 0 or (head is not None and head < 0) or top_n < 1 or sample_dims < 1:
            raise ValueError("layer and head must be >= 0, top_n and sample_dims >= 1")
        self.layer, self.head, self.top_n, self.sample_dims = layer, head, top_n, sample_dims
        self.on_step = on_step
        self.model: ModelRecord | dict = {}
        self.prompt: PromptRecord | dict = {}
        self.steps: list[StepRecord] = []
        self.summary: dict[str, Any] = {}
        self._step: StepRecord | None = None
        self._started = 0.0
        self._hook_s = 0.0  # time spent inside this step's hooks
        self._last_row: Tensor | None = None  # the residual stream before the current sublayer
        self._detok: IncrementalDetokenizer | None = None

    # ------------------------------------------------------------------ engine hooks
    def on_step_begin(self, seq, num_tokens: int) -> None:
        start = seq.num_computed
        decode = is_decode(seq, num_tokens)  # the scheduler's rule, as the model runner packs
        self._started, self._hook_s = time.perf_counter(), 0.0
        self._step = {
            "index": len(self.steps),
            "phase": "decode" if decode else "prefill",
            "start": start,
            "num_tokens": num_tokens,
            "input_ids": [seq.token_at(p) for p in range(start, start + num_tokens)],
            "layers": [],
            "blocks_held": len(seq.block_table),  # the scheduler grew the table already
        }

    @_timed
    def on_embedding(self, meta, input_ids: Tensor, x: Tensor) -> None:
        rows = x[meta.trace_rows]  # [n, d]
        self._step["positions"] = meta.positions[meta.trace_rows].tolist()
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
        kind, index = meta.trace_attn.kind, meta.trace_attn.index
        if site.kind != kind or (kind == "prefill" and site.index != index):
            return  # an attention call of other requests in the batch
        if kind == "decode":
            context = int(meta.decode_context_lens[index])
            q_seq, k_seq = q[index], keys[index, :, :context]  # [H, 1, hd], [Hkv, C, hd]
            m = mask[index, 0, :, :context]  # [1, C]
        else:
            q_seq, k_seq, m = q[0], keys[0], mask
        context = k_seq.shape[1]
        weights = _attention_weights(q_seq, k_seq, m, scale, context - q_seq.shape[1])
        heads, length, _ = weights.shape
        last = weights[:, -1]  # [H, C] the newest token's row
        self._step["layers"].append(
            {
                "layer": layer_idx,
                "q": [length, heads, q_seq.shape[-1]],
                "k": [context, k_seq.shape[0], k_seq.shape[-1]],
                "v": [context, k_seq.shape[0], k_seq.shape[-1]],
                "entropy": _round(_entropy(weights).mean(-1), 3),  # [H] bits, mean over rows
                "max": _round(weights.amax(-1).mean(-1), 3),  # [H] mean of each row's peak
                "argmax": last.argmax(-1).tolist(),  # [H] key most attended by the newest token
            }
        )
        if layer_idx == self.layer:
            picked = weights if self.head is None else weights[self.head : self.head + 1]
            rows = min(length, max(1, MAX_ATTENTION_CELLS // (picked.shape[0] * context)))
            self._step["attention"] = {
                "layer": layer_idx,
                "heads": list(range(heads)) if self.head is None else [self.head],
                "query_positions": list(range(context - rows, context)),
                "context": context,
                "weights": _round(picked[:, -rows:]),  # [heads][rows][C]: the newest rows
            }

    @_timed
    def on_residual(self, meta, layer_idx: int, sublayer: str, x: Tensor) -> None:
        row = x[meta.trace_rows][-1].float()
        update = row - self._last_row
        self._last_row = row.clone()
        layer = self._step["layers"][-1]  # on_attention of this layer came just before
        layer[f"{sublayer}_update_norm"] = round(float(update.norm()), 3)
        layer[f"{sublayer}_residual_norm"] = round(float(row.norm()), 3)

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
        self._step["sample"] = {
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
            self._step["sample"]["grammar"] = self._grammar(t, state, order, candidates)

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
            step["position_encoding"] = engine.position_encoding(
                step["positions"], self.sample_dims
            )
        if "sample" in step:
            self._finish_sample(step["sample"], seq, engine)
        step["kv"] = self._kv(step, seq, engine)
        self._last_row = None
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

    def _kv(self, step: dict[str, Any], seq, engine: EngineView) -> dict[str, Any]:
        """The request's KV cache after this step.

        Taken from the step itself (start + num_tokens tokens have K/V now) because a
        sequence that finished in this step has already handed its blocks back.
        """
        tokens = step["start"] + step["num_tokens"]
        return {
            "tokens": tokens,
            "bytes": tokens * engine.kv_bytes_per_token,
            "written": step["num_tokens"],
            "blocks": step.pop("blocks_held"),
            "released": seq.status is Status.FINISHED,
            "pool_blocks_used": engine.pool_blocks_used(),
            "pool_blocks_total": engine.pool_blocks_total,
        }

    def _summarise(self, seq) -> None:
        sampled = [s for s in self.steps if "sample" in s]
        first = next((i for i, s in enumerate(self.steps) if "sample" in s), None)
        end = len(self.steps) if first is None else first + 1
        prefill_ms = sum(s["step_ms"] for s in self.steps[:end])
        decode_ms = [s["step_ms"] for s in self.steps[first + 1 :]] if first is not None else []
        ttft = None
        if seq.first_token_time is not None:  # the engine's clock, less the tracer's own time
            traced_s = sum(s["trace_ms"] for s in self.steps[:end]) / 1000
            ttft = seq.first_token_time - seq.arrival - traced_s
        self.summary = {
            "output_ids": [s["sample"]["token"] for s in sampled],
            "text": "".join(s["sample"]["text"] for s in sampled),
            "prefill_ms": round(prefill_ms, 3),
            "decode_ms": decode_ms,
            "time_to_first_token_ms": round(ttft * 1000, 3) if ttft is not None else None,
            "decode_tokens_per_s": round(len(decode_ms) / sum(decode_ms) * 1000, 2)
            if decode_ms
            else None,
            "finish_reason": seq.finish_reason,
        }

    # ------------------------------------------------------------------ export
    def header(self) -> dict[str, Any]:
        """What the steps refer to: the model's shape, the prompt, the trace settings
        (filled in when the first step ends)."""
        return {
            "model": self.model,
            "prompt": self.prompt,
            "trace": {"layer": self.layer, "head": self.head, "top_n": self.top_n},
        }

    def to_dict(self) -> TraceRecord:
        """Everything recorded, as JSON-able data (trace_schema.py)."""
        return {**self.header(), "steps": self.steps, "summary": self.summary}

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))
