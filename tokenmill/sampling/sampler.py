"""Batched token sampling: every row of a decode step carries its own parameters.

The pipeline is a chain of small pure tensor functions, applied in this order:

    apply_penalties -> apply_logit_bias -> apply_dry -> apply_token_mask (grammar) -> apply_temperature
        -> top_k_mask -> top_p_mask -> min_p_mask -> typical_mask -> top_n_sigma_mask
        -> xtc_mask -> mirostat_mask -> sample_from_probs (-> the mirostat rows' mu update)

Each takes and returns batched tensors ([B, V] logits plus [B] per-row
parameters) and never mutates its inputs, so the inspector can run them one at
a time on a single row (`process_logits`) and show what each stage did, while
the engine's `Sampler` runs exactly the same functions over a whole batch.

Filters are applied sequentially, like Hugging Face's warpers: each mask is
computed on the logits left by the previous one, so top-p's cumulative mass is
measured over the top-k survivors, renormalised. Neither sorts the vocabulary:
both take the few largest values with topk and break ties by token id, which is
what a stable sort would keep (sorting 150k logits costs tens of ms on CPU).
Greedy rows (temperature 0 or top_k 1) skip all of this and take the argmax
of the penalised logits.

Rows with a structured-output constraint get the grammar's token mask
(tokenmill/sampling/grammar.py) as a stage of its own, after the logit
processors: disallowed tokens become -inf, so everything after it (and the argmax)
only sees tokens the grammar allows. The masks of all constrained rows are
computed together; other rows are never touched.

Randomness is per request: a seeded row owns a torch.Generator and draws exactly
V exponentials from it per step (the "exponential race": argmax(p / q) with
q ~ Exp(1) picks token i with probability p_i), so its tokens do not depend on
which other rows share the batch. Unseeded rows share torch's default generator
and are drawn in one call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tokenmill.checks import ParamError
from tokenmill.sampling import dry
from tokenmill.sampling.dry import Breakers
from tokenmill.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.sampling.grammar import CompiledGrammar, GrammarMatcher

_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1
_TOP_P_FIRST_WIDTH = 256  # candidates top_p_mask looks at before widening


# --------------------------------------------------------------------------- pipeline stages


def apply_penalties(
    logits: Tensor,
    seen: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
) -> Tensor:
    """Repetition (HF/vLLM), then frequency and presence (OpenAI) penalties.

    logits: [B, V] float; seen: [B, V] bool, token occurs in the prompt or the
    output; output_counts: [B, V] float, occurrences in the output only;
    the three penalties: [B]. Returns new [B, V] logits.
    """
    rep = repetition_penalty[:, None]  # [B, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    present = (output_counts > 0).to(logits.dtype)
    return logits - frequency_penalty[:, None] * output_counts - presence_penalty[:, None] * present


def apply_logit_bias(logits: Tensor, rows: Tensor, token_ids: Tensor, bias: Tensor) -> Tensor:
    """Add a sparse bias: logits[rows[j], token_ids[j]] += bias[j].

    logits: [B, V]; rows, token_ids: [M] long; bias: [M] float. Returns new logits.
    """
    return logits.index_put((rows, token_ids), bias.to(logits.dtype), accumulate=True)


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide each row by its temperature. logits: [B, V]; temperature: [B], all > 0.

    Temperature 0 (greedy) is the caller's business: it takes the argmax instead.
    """
    return logits / temperature[:, None].to(logits.dtype)


def _keep_n_largest(values: Tensor, n: Tensor, largest: Tensor) -> Tensor:
    """Keep the n largest values of each row; ties at the cut go to lower token ids.

    The result is what a stable descending sort would keep, without sorting the
    row. bf16 logits tie often, so the rule matters, and it depends only on the
    row (not on the batch around it).
    values: [B, V]; n: [B] in [1, W]; largest: [B, W], the W largest values of
    each row in descending order. Returns keep mask [B, V] bool.
    """
    vocab, width = values.shape[-1], largest.shape[-1]
    nth = largest.gather(-1, (n - 1)[:, None])  # [B, 1] smallest kept value
    # Common case: the (n+1)-th value is strictly smaller, so ">= nth" keeps exactly n.
    following = largest.gather(-1, n.clamp(max=width - 1)[:, None])  # [B, 1]
    exact = (n == vocab) | ((n < width) & (following[:, 0] < nth[:, 0]))  # [B]
    if bool(exact.all()):
        return values >= nth
    # Otherwise keep every value above the cut and the lowest-id ties that still fit.
    room = n - (largest > nth).sum(-1)  # [B] tied tokens still to keep
    tied = values == nth  # [B, V]
    return (values > nth) | (tied & (tied.cumsum(-1) <= room[:, None]))


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep exactly the k highest logits per row; ties go to the lower token id.

    logits: [B, V]; top_k: [B] long, 0 = keep all. Returns keep mask [B, V] bool.
    """
    vocab = logits.shape[-1]
    off = (top_k <= 0) | (top_k >= vocab)  # [B] rows that keep everything
    if bool(off.all()):
        return torch.ones_like(logits, dtype=torch.bool)
    k = torch.where(off, 1, top_k)  # [B]
    # One extra value shows whether the k-th is tied with the next.
    largest = logits.topk(min(vocab, int(k.max()) + 1), dim=-1).values  # [B, W], descending
    return _keep_n_largest(logits, k, largest) | off[:, None]


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most probable tokens whose total mass reaches p.

    A token is kept when the mass of the tokens ranked strictly before it is
    still < p, so the first token always survives. Rows with p == 1 keep all.
    Rather than sorting the whole vocab (tens of ms per row on CPU), take the
    top candidates and widen until every row's nucleus fits inside them.
    logits: [B, V]; top_p: [B] in (0, 1]. Returns keep mask [B, V] bool.
    """
    vocab = logits.shape[-1]
    probs = logits.softmax(-1)  # [B, V]
    p = top_p.to(probs.dtype)  # [B]
    off = p >= 1.0  # [B] rows that keep everything
    width = min(vocab, _TOP_P_FIRST_WIDTH)
    while True:
        largest = probs.topk(width, dim=-1).values  # [B, W], descending
        mass = largest.cumsum(-1)  # [B, W]
        if width == vocab or bool(((mass[:, -1] >= p) | off).all()):
            break
        width = min(vocab, width * 8)
    mass_before = F.pad(mass[:, :-1], (1, 0))  # [B, W] exclusive cumsum
    n = (mass_before < p[:, None]).sum(-1)  # [B] nucleus size, >= 1
    return _keep_n_largest(probs, n, largest) | off[:, None]


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens whose probability is >= min_p times the row's top probability.

    logits: [B, V]; min_p: [B] in [0, 1]. Returns keep mask [B, V] bool.
    """
    probs = logits.softmax(-1)  # [B, V]
    threshold = min_p[:, None].to(probs.dtype) * probs.amax(-1, keepdim=True)  # [B, 1]
    return probs >= threshold


def typical_mask(logits: Tensor, typical_p: Tensor) -> Tensor:
    """Locally typical sampling: rank tokens by how far their surprisal -log p lies from
    the entropy H of the row, and keep them in that order until the mass kept before a
    token exceeds p (the first always survives), as llama.cpp's typical sampler and
    transformers' TypicalLogitsWarper do. A full sort of the row (the ranking is not by
    probability, so top-p's partial topk does not apply).
    logits: [B, V] (dropped tokens -inf); typical_p: [B] in (0, 1], 1 = off. Returns keep
    mask [B, V] bool."""
    p = typical_p.to(logits.dtype)  # [B]
    off = p >= 1.0
    if bool(off.all()):
        return torch.ones_like(logits, dtype=torch.bool)
    logp = logits.log_softmax(-1)  # [B, V]
    probs = logp.exp()
    dropped = probs == 0
    entropy = -(probs * logp.masked_fill(dropped, 0.0)).sum(-1, keepdim=True)  # [B, 1]
    distance = (-logp - entropy).abs().masked_fill(dropped, float("inf"))  # [B, V]
    order = distance.argsort(dim=-1, stable=True)  # [B, V]: most typical first
    ranked = probs.gather(-1, order)
    before = ranked.cumsum(-1) - ranked  # [B, V] mass ranked before each token
    keep_ranked = (before <= p[:, None]) & ~dropped.gather(-1, order)
    keep_ranked[:, 0] = True
    keep = torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)
    return keep | off[:, None]


def top_n_sigma_mask(logits: Tensor, n: Tensor) -> Tensor:
    """Top-n-sigma: keep the logits within n standard deviations (over the row's finite
    logits, population) of its largest, as llama.cpp's top_n_sigma sampler does. A
    positive temperature scales the logits and their deviation alike, so the mask is the
    same before or after it.
    logits: [B, V]; n: [B] >= 0, 0 = off. Returns keep mask [B, V] bool."""
    off = n <= 0  # [B]
    if bool(off.all()):
        return torch.ones_like(logits, dtype=torch.bool)
    finite = torch.isfinite(logits)
    count = finite.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    zeroed = logits.masked_fill(~finite, 0.0)
    mean = zeroed.sum(-1, keepdim=True) / count
    var = ((zeroed - mean).masked_fill(~finite, 0.0) ** 2).sum(-1, keepdim=True) / count
    top = logits.amax(-1, keepdim=True)  # [B, 1]
    keep = logits >= top - n[:, None].to(logits.dtype) * var.sqrt()
    return keep | off[:, None]


def xtc_mask(logits: Tensor, threshold: Tensor, fire: Tensor) -> Tensor:
    """XTC, "exclude top choices", as llama.cpp's xtc sampler: in rows where it fires, of
    the tokens at least `threshold` likely drop all but the least likely, when there are
    two or more. logits: [B, V] (dropped tokens -inf); threshold: [B]; fire: [B] bool (the
    row's coin came up, drawn by the caller). Returns keep mask [B, V] bool."""
    probs = logits.softmax(-1)  # [B, V]
    above = probs >= threshold[:, None].to(probs.dtype)
    least = probs.masked_fill(~above, float("inf")).amin(-1, keepdim=True)  # [B, 1]
    drop = above & (probs > least) & (fire & (above.sum(-1) >= 2))[:, None]
    return ~drop


def mirostat_mask(logits: Tensor, mu: Tensor) -> Tensor:
    """Mirostat v2's cut, as llama.cpp's mirostat_v2 sampler: keep the tokens whose
    surprise -log2 p is at most mu (the most likely always). logits: [B, V] (dropped
    tokens -inf); mu: [B]. Returns keep mask [B, V] bool."""
    logp = logits.log_softmax(-1)  # [B, V]
    keep = -logp / math.log(2) <= mu[:, None].to(logp.dtype)
    return keep | (logp == logp.amax(-1, keepdim=True))


def mask_logits(logits: Tensor, keep: Tensor) -> Tensor:
    """Set dropped tokens to -inf, so a softmax renormalises over the survivors."""
    return logits.masked_fill(~keep, float("-inf"))


def sample_from_probs(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Draw one token per row by exponential race: argmax(probs / q), q ~ Exp(1).

    probs: [B, V]; generators: one per row, None = torch's default generator.
    Each seeded row draws exactly V numbers from its own generator, so its result
    is independent of the rest of the batch. Returns token ids [B] long.
    """
    q = torch.empty_like(probs)  # [B, V]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        q.exponential_()
    else:
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            q[idx] = torch.empty(len(unseeded), probs.shape[-1], device=probs.device).exponential_()
    # A zero draw would make 0/0 = NaN for a filtered token and poison the argmax.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(-1)


# --------------------------------------------------------------------------- per-request state


def _derive_seed(seed: int, completion_index: int) -> int:
    """Seed for the i-th of n completions: the request seed itself for i == 0,
    a splitmix64 mix of (seed, i) otherwise, so n seeded completions differ."""
    if completion_index == 0:
        return seed
    z = (seed + completion_index * _SPLITMIX_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplingState:
    """Everything the sampler needs about one running sequence; lives across steps.

    Penalty bookkeeping is incremental: `seen` and `output_counts` are updated in
    O(1) by `append`, so a step never walks the token history in Python. They are
    only allocated when the request uses a penalty.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    vocab_size: int
    seen: Tensor | None = None  # [V] bool: in prompt or output (repetition penalty)
    output_counts: Tensor | None = None  # [V] float32: occurrences in output
    bias_ids: Tensor | None = None  # [M] long
    bias_values: Tensor | None = None  # [M] float32
    grammar: GrammarMatcher | None = None  # the structured-output constraint's position
    mu: float | None = None  # Mirostat v2's current maximum surprise (bits); None: off
    dry_breakers: Breakers | None = None  # DRY's sequence breakers; None: DRY is off
    dry_context: np.ndarray | None = None  # [capacity] int64: prompt, then output, for DRY
    dry_length: int = 0  # how many of dry_context's entries are tokens

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        device: torch.device | str = "cpu",
        *,
        vocab_size: int,
        completion_index: int = 0,
        grammar: CompiledGrammar | None = None,
        dry_breakers: Breakers | None = None,
    ) -> SamplingState:
        """Build the state for one completion of a request.

        vocab_size is the width of the model's logits; logit_bias and stop_token_ids ids
        are checked against it here, so a bad request fails before it joins a batch (a
        stop id no token can be would never stop anything).
        completion_index (0..n-1) decorrelates the n completions of a seeded request.
        grammar: params' constraint compiled (LLMEngine.compile_grammar); each completion
        gets its own matcher on it.
        dry_breakers: params' dry_sequence_breakers found in the vocabulary
        (dry.sequence_breakers); needed, and only used, when params turn DRY on.
        """
        if (params.constraint is None) != (grammar is None):
            raise ValueError("a constrained request needs its compiled grammar, and only it")
        if grammar is not None and grammar.vocab_size != vocab_size:
            raise ValueError(f"grammar compiled for vocab {grammar.vocab_size}, not {vocab_size}")
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            bad = max(params.logit_bias)
            raise ParamError(
                f"logit_bias token id {bad} is out of range for vocab size {vocab_size}",
                "logit_bias",
            )
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
            raise ParamError(
                f"stop_token_ids id {max(params.stop_token_ids)} is out of range for vocab "
                f"size {vocab_size}",
                "stop_token_ids",
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(_derive_seed(params.seed, completion_index))
        state = cls(params, generator, list(prompt_ids), vocab_size)
        if params.mirostat == 2:
            state.mu = 2.0 * params.mirostat_tau
        if params.dry:
            if dry_breakers is None:
                raise ValueError("a DRY request needs its sequence breakers")
            state.dry_breakers = dry_breakers
            state.dry_context = np.empty(max(64, 2 * len(state.prompt_ids)), np.int64)
            state.dry_context[: len(state.prompt_ids)] = state.prompt_ids
            state.dry_length = len(state.prompt_ids)
        if grammar is not None:
            state.grammar = grammar.matcher()
        uses_penalties = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        if uses_penalties:
            state.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.seen[torch.tensor(state.prompt_ids, dtype=torch.long, device=device)] = True
            state.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.logit_bias:
            state.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            state.bias_values = torch.tensor(
                list(params.logit_bias.values()), dtype=torch.float32, device=device
            )
        return state

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw row."""
        return (
            self.params.greedy
            and self.seen is None
            and self.bias_ids is None
            and self.grammar is None
            and self.dry_breakers is None
        )

    def append(self, token_id: int) -> None:
        """Record the token sampled for this sequence in the last step (the penalties'
        counts, the grammar's position; the sequence keeps the tokens themselves)."""
        if self.seen is not None and self.output_counts is not None:
            self.seen[token_id] = True
            self.output_counts[token_id] += 1
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if self.dry_context is not None:
            if self.dry_length == len(self.dry_context):
                self.dry_context = np.concatenate([self.dry_context, self.dry_context])
            self.dry_context[self.dry_length] = token_id
            self.dry_length += 1

    def dry_window(self) -> np.ndarray:
        """[N] int64: the last dry_penalty_last_n tokens of prompt and output (all when -1)."""
        last_n = self.params.dry_penalty_last_n
        start = 0 if last_n < 0 else max(0, self.dry_length - last_n)
        return self.dry_context[start : self.dry_length]


# --------------------------------------------------------------------------- shared batch logic


def _per_row(values: list[float], like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """One parameter per row as a [B] tensor on the logits' device."""
    return torch.tensor(values, dtype=dtype, device=like.device)


def _adjust(logits: Tensor, states: Sequence[SamplingState], constrain: bool = True) -> Tensor:
    """Penalties, logit_bias, then (unless constrain is False) the grammar mask, each on
    the rows that use it. logits: [B, V] -> [B, V]."""
    rows = [i for i, s in enumerate(states) if s.seen is not None]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        sub = [states[i] for i in rows]
        penalised = apply_penalties(
            logits[idx],
            torch.stack([s.seen for s in sub]),
            torch.stack([s.output_counts for s in sub]),
            _per_row([s.params.repetition_penalty for s in sub], logits),
            _per_row([s.params.presence_penalty for s in sub], logits),
            _per_row([s.params.frequency_penalty for s in sub], logits),
        )
        logits = logits.index_copy(0, idx, penalised)
    rows = [i for i, s in enumerate(states) if s.bias_ids is not None]
    if rows:
        ids = [states[i].bias_ids for i in rows]
        row_idx = torch.cat([torch.full_like(t, i) for i, t in zip(rows, ids, strict=True)])
        values = torch.cat([states[i].bias_values for i in rows])
        logits = apply_logit_bias(logits, row_idx, torch.cat(ids), values)
    rows = [i for i, s in enumerate(states) if s.dry_breakers is not None]
    if rows:
        logits = apply_dry(logits, rows, [states[i] for i in rows])
    if constrain:
        logits = _constrain(logits, states)
    return logits


def apply_dry(logits: Tensor, rows: list[int], states: Sequence[SamplingState]) -> Tensor:
    """Subtract each row's DRY penalties (dry.penalties over its context) from its
    logits. logits: [B, V]; rows: the rows states describe. Returns new [B, V] logits."""
    row_idx, token_ids, amounts = [], [], []
    for i, s in zip(rows, states, strict=True):
        p = s.params
        ids, values = dry.penalties(
            s.dry_window(), s.dry_breakers, p.dry_multiplier, p.dry_base, p.dry_allowed_length
        )
        keep = ids < logits.shape[-1]
        row_idx.append(np.full(int(keep.sum()), i, np.int64))
        token_ids.append(ids[keep])
        amounts.append(-values[keep])
    if not sum(len(t) for t in token_ids):
        return logits
    return apply_logit_bias(
        logits,
        torch.from_numpy(np.concatenate(row_idx)).to(logits.device),
        torch.from_numpy(np.concatenate(token_ids)).to(logits.device),
        torch.from_numpy(np.concatenate(amounts)).to(logits.device),
    )


def _constrain(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """The grammar stage: -inf for the tokens each constrained row's grammar forbids."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return logits
    from tokenmill.sampling.grammar import allowed_tokens, apply_token_mask

    allowed = allowed_tokens([states[i].grammar for i in rows])  # [R, V]
    return apply_token_mask(logits, torch.tensor(rows, device=logits.device), allowed)


@dataclass(frozen=True)
class _Filtered:
    scaled: Tensor  # [B, V] logits after temperature
    keep_top_k: Tensor  # [B, V] bool survivors after top-k
    keep_top_p: Tensor  # [B, V] bool survivors after top-k and top-p
    keep: Tensor  # [B, V] bool survivors after top-k, top-p, min-p, typical-p, top-n-sigma


def _filter(logits: Tensor, states: Sequence[SamplingState], draw: bool = False) -> _Filtered:
    """Temperature and the three truncations for non-greedy rows. logits: [B, V]."""
    params = [s.params for s in states]
    scaled = apply_temperature(logits, _per_row([p.temperature for p in params], logits))
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if any(p.top_k for p in params):
        keep = top_k_mask(scaled, _per_row([p.top_k for p in params], logits, torch.long))
    keep_top_k = keep
    if any(p.top_p < 1.0 for p in params):
        keep = keep & top_p_mask(
            mask_logits(scaled, keep), _per_row([p.top_p for p in params], logits)
        )
    keep_top_p = keep
    if any(p.min_p > 0.0 for p in params):
        # No need to mask first: the top token always survives top-k and top-p, and
        # renormalising over survivors leaves every ratio to its probability unchanged.
        keep = keep & min_p_mask(scaled, _per_row([p.min_p for p in params], logits))
    # transformers' order: typical-p over what top-k, top-p and min-p left
    if any(p.typical_p < 1.0 for p in params):
        keep = keep & typical_mask(
            mask_logits(scaled, keep), _per_row([p.typical_p for p in params], logits)
        )
    if any(p.top_n_sigma > 0.0 for p in params):  # over the whole row, as llama.cpp's
        keep = keep & top_n_sigma_mask(scaled, _per_row([p.top_n_sigma for p in params], logits))
    # XTC's coin and Mirostat's mu change from step to step: only a step that samples
    # (draw) applies them, so the inspector's replay of a row (process_logits) draws no
    # random number from a request's generator and moves no mu
    if draw and any(p.xtc_probability > 0.0 for p in params):
        fire = torch.tensor(
            [
                p.xtc_probability > 0.0 and _uniform(s.generator) <= p.xtc_probability
                for s, p in zip(states, params, strict=True)
            ]  # fmt: skip
        )
        thresholds = _per_row([p.xtc_threshold for p in params], logits)
        keep = keep & xtc_mask(mask_logits(scaled, keep), thresholds, fire)
    if draw and any(s.mu is not None for s in states):
        mu = _per_row([s.mu if s.mu is not None else math.inf for s in states], logits)
        keep = keep & mirostat_mask(mask_logits(scaled, keep), mu)
    return _Filtered(scaled, keep_top_k, keep_top_p, keep)


def _uniform(generator: torch.Generator | None) -> float:
    """One draw from U[0, 1) on a row's generator (torch's default without one)."""
    return float(torch.rand(1, generator=generator))


def _move_mu(states: Sequence[SamplingState], probs: Tensor, token_ids: Tensor) -> None:
    """Mirostat v2's update after a draw: mu -= eta * (-log2 p(token) - tau), p the drawn
    token's probability in the distribution it was drawn from. probs: [B, V]."""
    for i, s in enumerate(states):
        if s.mu is not None:
            surprise = -math.log2(float(probs[i, token_ids[i]]))
            s.mu -= s.params.mirostat_eta * (surprise - s.params.mirostat_tau)


# --------------------------------------------------------------------------- inspector view


@dataclass(frozen=True)
class LogitsTrace:
    """Every intermediate of the pipeline for one row, all [V]."""

    raw_logits: Tensor  # model output
    logits: Tensor  # after penalties, logit_bias and DRY (before the grammar mask)
    allowed: Tensor | None  # bool: what the grammar allows; None without a constraint
    probs: Tensor  # softmax of the logits left by the grammar: before temperature
    scaled_probs: Tensor  # after temperature (one-hot at the argmax when greedy)
    keep_top_k: Tensor  # bool survivors after top-k
    keep_top_p: Tensor  # bool survivors after top-k, top-p
    keep: Tensor  # bool survivors after top-k, top-p, min-p, typical-p, top-n-sigma
    final_probs: Tensor  # renormalised over `keep`: what the token is drawn from


def process_logits(logits_row: Tensor, state: SamplingState) -> LogitsTrace:
    """Run the sampler's pipeline on one row ([V]) and return every intermediate."""
    raw = logits_row.float()[None]  # [1, V]
    unmasked = _adjust(raw, [state], constrain=False)
    logits = _constrain(unmasked, [state])
    allowed = state.grammar.allowed() if state.grammar is not None else None
    probs = logits.softmax(-1)
    if state.params.greedy:
        # The temperature -> 0 limit: all mass on the argmax, which the sampler takes.
        chosen = torch.zeros_like(logits[0], dtype=torch.bool)
        chosen[logits[0].argmax()] = True
        return LogitsTrace(
            raw_logits=raw[0],
            logits=unmasked[0],
            allowed=allowed,
            probs=probs[0],
            scaled_probs=chosen.float(),
            keep_top_k=chosen,
            keep_top_p=chosen,
            keep=chosen,
            final_probs=chosen.float(),
        )
    f = _filter(logits, [state])
    return LogitsTrace(
        raw_logits=raw[0],
        logits=unmasked[0],
        allowed=allowed,
        probs=probs[0],
        scaled_probs=f.scaled[0].softmax(-1),
        keep_top_k=f.keep_top_k[0],
        keep_top_p=f.keep_top_p[0],
        keep=f.keep[0],
        final_probs=mask_logits(f.scaled, f.keep)[0].softmax(-1),
    )


# --------------------------------------------------------------------------- the engine's sampler


@dataclass
class SampleOutput:
    token_ids: list[int]  # chosen token per row
    logprobs: list[float | None]  # chosen token's logprob; None if the row didn't ask
    top_logprobs: list[dict[int, float] | None]  # top-N token id -> logprob, best first


def _logprobs(
    raw: Tensor, token_ids: Tensor, states: Sequence[SamplingState]
) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """vLLM semantics: log_softmax of the raw model logits, before any processing."""
    n_rows = len(states)
    chosen: list[float | None] = [None] * n_rows
    top: list[dict[int, float] | None] = [None] * n_rows
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return chosen, top
    idx = torch.tensor(rows, device=raw.device)
    logprobs = raw[idx].log_softmax(-1)  # [R, V]
    chosen_lp = logprobs.gather(-1, token_ids[idx, None])[:, 0].tolist()  # [R]
    widest = max(states[i].params.logprobs for i in rows)
    top_values, top_ids = logprobs.topk(widest, dim=-1)  # [R, N], sorted descending
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = states[i].params.logprobs
        chosen[i] = chosen_lp[j]
        top[i] = dict(zip(top_ids[j][:n], top_values[j][:n], strict=True))
    return chosen, top


def first_argmax(x: Tensor) -> Tensor:
    """[B, V] -> [B]: the first index of each row's maximum. On the CPU through numpy, a
    visible part of a decode step otherwise: for a 49152-wide row 6 us against 52 for
    argmax(-1) and 103 for max(-1).indices (Zen 3, 2 threads; on a Xeon max() was the
    faster torch call, 30 us)."""
    if x.device.type == "cpu" and x.is_contiguous():
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.max(-1).indices


class Sampler:
    """Chooses the next token for every row of a step: `sampler(logits, states)`."""

    def __call__(self, logits: Tensor, states: Sequence[SamplingState]) -> SampleOutput:
        # logits: [B, V]; states[i] describes row i.
        if logits.shape[0] != len(states):
            raise ValueError(f"got {logits.shape[0]} logit rows for {len(states)} states")
        if any(s.vocab_size != logits.shape[-1] for s in states):
            raise ValueError(f"logits have width {logits.shape[-1]}, states expect another vocab")
        raw = logits.float()
        moved = None  # the mirostat rows' (states, final probs, drawn tokens)
        if all(s.plain_greedy for s in states):
            token_ids = first_argmax(raw)  # [B] fast path: nothing to process
        else:
            adjusted = _adjust(raw, states)  # [B, V]
            token_ids = first_argmax(adjusted)  # [B] right for greedy rows; others overwritten
            rows = [i for i, s in enumerate(states) if not s.params.greedy]
            if rows:
                sub = [states[i] for i in rows]
                idx = torch.tensor(rows, device=raw.device)
                f = _filter(adjusted if len(rows) == len(states) else adjusted[idx], sub, True)
                probs = mask_logits(f.scaled, f.keep).softmax(-1)  # [R, V]
                drawn = sample_from_probs(probs, [s.generator for s in sub])
                token_ids[idx] = drawn
                moved = (sub, probs, drawn)
        chosen, top = _logprobs(raw, token_ids, states)
        if moved is not None:  # last: a step that raised before here moved no mu
            _move_mu(*moved)
        return SampleOutput(token_ids.tolist(), chosen, top)
