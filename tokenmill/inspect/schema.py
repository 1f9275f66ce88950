"""The trace's JSON, declared: what `Trace.to_dict()` holds (and `POST /v1/inspect`
streams), the one schema that `tokenmill inspect` (inspect/view.py) and the web page
(server/static/app.js) read. Keys not marked optional are always present once the step
that fills them has ended. Over HTTP the JSON is compact (trace.dumps); a streamed step
event carries the summary's scalars only (Trace.live_summary)."""

from __future__ import annotations

from typing import Any, TypedDict


class ModelRecord(TypedDict):
    name: str
    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    position: str  # "rope" | "learned"
    rope_theta: float | None
    mlp: str  # "gated" | "plain"
    activation: str
    norm: str
    tie_embeddings: bool
    num_experts: int  # MoE experts per sparse layer (0: a dense model)
    experts_per_token: int  # the router's k (0: a dense model)
    dtype: str
    weights: str  # models/quantize.py's scheme, or "torch"
    kernels: str  # the native kernels' instruction set
    prefill: str  # how prompt-sized products run: integer GEMM, float32 tiles or torch
    decode_path: str  # models/paths.py: what an untraced decode step runs
    decode_path_reason: str
    parallel: list[str] | None  # what each rank holds, in a parallel run
    kv_bytes_per_token: int
    block_size: int
    kv_capacity_tokens: int
    kv_capacity_bytes: int


class PromptRecord(TypedDict):
    ids: list[int]
    pieces: list[str]
    texts: list[str]
    text: str


class RouterRecord(TypedDict):
    """An MoE layer's router choice for the step's rows: row i is the step's token at
    positions[i], for the first 512 rows (trace.MAX_SAMPLE_ROWS)."""

    ids: list[list[int]]  # [rows][k] the chosen experts, best first
    weights: list[list[float]]  # [rows][k] what each one's output is scaled by


class LayerRecord(TypedDict, total=False):
    layer: int
    q: list[int]  # [rows, heads, head_dim]: the step's whole chunk
    k: list[int]  # [context, kv heads, head_dim]
    v: list[int]
    summary_rows: int  # the chunk's last rows the summaries below are taken over (<= 16)
    entropy: list[float]  # [heads] bits, mean over those rows
    max: list[float]  # [heads] mean of each of those rows' peak weight
    argmax: list[int]  # [heads] key most attended by the newest token
    attention_update_norm: float  # ||what the attention sublayer added to x||
    attention_residual_norm: float
    mlp_update_norm: float  # the MLP sublayer's
    mlp_residual_norm: float
    experts: RouterRecord  # optional: MoE layers only


class Candidate(TypedDict, total=False):
    id: int
    logit: float
    prob: float  # softmax of the raw logits
    scaled_prob: float  # after temperature
    final_prob: float  # after the filters, renormalised
    kept: bool  # survived top-k/top-p/min-p and the grammar
    allowed: bool  # allowed by the grammar
    unconstrained_prob: float  # optional: constrained steps only
    piece: str
    text: str


class GrammarRecord(TypedDict):
    kind: str
    allowed: int  # vocabulary entries the grammar allowed at this step
    vocab: int
    masked: list[int]  # top candidates it masked out, best first
    masked_mass: float  # their share of the unconstrained probability


class SampleRecord(TypedDict, total=False):
    token: int
    prob: float
    prob_before_temperature: float
    rank: int
    vocab: int
    params: dict[str, Any]  # temperature, top_k, top_p, min_p, greedy
    entropy: float
    entropy_after_temperature: float
    survivors: dict[str, int]  # after top_k, top_p, min_p
    final_sum: float
    candidates: list[Candidate]
    grammar: GrammarRecord  # optional: constrained steps only
    piece: str
    token_text: str
    is_stop: bool  # the engine's stop rule (sampling/stop.py)
    text: str  # what the detokenizer released ("" for a stop token)
    # optional, a verification step's rows that follow a guess: the guess, the target's
    # final probability of it here, and whether the drawn token was it
    guess: int
    guess_prob: float
    guess_accepted: bool


class SpeculationRecord(TypedDict):
    """A verification step (speculative decoding, engine/speculative.py): the guesses
    that ran as rows after the sequence's last token, and what became of them."""

    method: str  # "ngram" | "draft"
    proposed: list[int]  # the guesses, in order
    proposed_pieces: list[str]
    proposed_texts: list[str]
    accepted: int  # the longest prefix of them the target agreed with
    emitted: int  # tokens this step appended: accepted + 1, fewer if a stop came first
    rolled_back: int  # the rejected guesses' K/V rows, given back to the pool
    plain_step_ms: float | None  # median of this trace's plain decode steps so far
    step_vs_plain: float | None  # this step's step_ms over plain_step_ms
    engine_verify_cost: float | None  # untraced: a verification over a decode step's time


class KVRecord(TypedDict):
    tokens: int
    bytes: int
    written: int
    rolled_back: int  # of the rows written, a verification's rejected guesses' (given back)
    blocks: int
    released: bool
    pool_blocks_used: int
    pool_blocks_total: int


class AttentionMap(TypedDict):
    """One layer's attention weights in one step, for the heads asked for. A prefill step
    holds its rows at the trace's map_from or later (the prompt's last rows), a decode step
    its one row; a query row's weights past its own position are 0 (masked)."""

    layer: int
    heads: list[int]
    query_positions: list[int]  # [rows]
    context: int  # keys per row
    weights: list[list[list[float]]]  # [heads][rows][context], rounded to 4 decimals


class TraceSettings(TypedDict):
    layers: list[int]  # the layers with attention maps ([]: none)
    heads: list[int] | None  # their heads (None: every head)
    top_n: int
    summary_rows: int  # trace.SUMMARY_ROWS
    map_from: int | None  # first prompt position with map rows (None until a step ran)


class StepRecord(TypedDict, total=False):
    index: int
    phase: str  # "prefill" | "decode" (engine/scheduler.py::is_decode) | "verify" (guesses)
    start: int
    num_tokens: int
    input_ids: list[int]
    input_pieces: list[str]
    positions: list[int]
    position_encoding: dict[str, Any]  # models/positions.py's position_sample
    embedding: dict[str, Any]  # shape, sample, norms
    layers: list[LayerRecord]
    attention: list[AttentionMap]  # optional: one per map layer with rows in this step
    sample: SampleRecord  # optional: steps that yield a token (a verification: its last)
    samples: list[SampleRecord]  # optional: a verification's, one per token it emitted
    speculation: SpeculationRecord  # optional: verification steps only
    kv: KVRecord
    step_ms: float
    trace_ms: float
    since_arrival_ms: float


class TraceRecord(TypedDict):
    model: ModelRecord
    prompt: PromptRecord
    trace: TraceSettings
    steps: list[StepRecord]
    summary: dict[str, Any]  # output_ids, text, timings, finish_reason, verify_steps/tokens
