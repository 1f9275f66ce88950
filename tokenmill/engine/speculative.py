"""Speculative decoding: guess a sequence's next tokens, verify them in one step.

    LLMEngine(speculative="ngram") or speculative={"method": "ngram", "k": 4, ...}
        -> SpeculativeConfig.parse; the engine keeps one Speculator.
    Scheduler, for a decoding sequence:  Speculator.propose(seq)  -> up to k guesses
        the sequence runs its last token and the guesses as one chunk of 1 + k rows over
        its cached context (the chunked-prefill path), and the model scores every row.
    LLMEngine.step, row by row:  sample row j exactly as a plain decode would (same
        penalties, bias, grammar, filters, generator), append the token; go on to row
        j + 1 only while the token equals guess j and nothing finished. Then
        Speculator.record(seq, proposed, accepted), and the rejected rows' K/V slots are
        given back (BlockManager.truncate).

Proposals, `draft` (a second, smaller model with the same tokenizer; LLMEngine builds it as
an engine of its own, with its own KV pool and prefix cache): the sequence's tokens are
queued on the draft engine as a prompt and it decodes k greedy tokens, which are the
guesses; the request then ends there, so the draft holds no block between steps. Its
prefix cache keeps the full blocks it computed last time, so each proposal recomputes
only the tokens past the last full block (under one block plus the tokens accepted
since) before its k decode steps. The proposal's time counts in the verification step's,
so the adaptive rule below weighs the draft's cost too.

Proposals, `ngram` (prompt lookup; vLLM's names: num_speculative_tokens, prompt_lookup_max,
prompt_lookup_min): for n from prompt_lookup_max down to prompt_lookup_min, the sequence's
last n tokens are looked up earlier in its prompt + output; the most recent earlier
occurrence wins and the up-to-k tokens that followed it are the guesses. A sequence with no
match proposes nothing and runs as a plain decode row. An index per sequence (n-gram ->
latest start) is brought up to date as tokens arrive, so a proposal costs O(n) dict look-ups,
not a scan of the context.

Why verification is exact. For a point-mass draft (a guess x, q(x) = 1) the standard
speculative-sampling rule accepts x with probability min(1, p(x) / q(x)) = p(x) and, on a
rejection, draws from norm(max(0, p - q)): p with x's mass removed, renormalised. Drawing
y ~ p and accepting iff y == x is the same rule: P(accept) = p(x), and given a rejection y
is y != x with probability p(y) / (1 - p(x)). So the engine draws each row's token with the
sampler itself (p is the sampler's final distribution: penalties over the tokens accepted so
far, logit bias, grammar mask, temperature, top-k/top-p/min-p) and compares. A seeded
request draws the same V exponentials per emitted token as without speculation, so its
output is token-identical, sampled or greedy; a grammar-forbidden guess is never drawn, so
it is always rejected. Greedy is the limit: accept the longest prefix agreeing with the
argmax, plus the target's token after it.

When it runs (plain text must not get slower): only while at most `max_running` sequences
run (a big batch already fills the weights' pass); k per sequence follows its acceptance
(all accepted: k + 2, up to k_max; else k - 1, down to 1, the rule of transformers'
assisted generation); and a verification must pay. The engine times its steps that run
one sequence alone (observe): `cost` is a verification step's time over a plain decode
step's, both as moving averages. A sequence's gain is its moving average of tokens per
verification (accepted + 1). A verification that accepted nothing, or leaves the gain
under the cost, is fruitless: the sequence rests for 2, 4, 8... up to MAX_REST decode
steps before it proposes again, so where guesses do not pay they are tried rarely (one
fruitless try in MAX_REST + 1 steps costs about cost - 1 steps' time). adaptive=False
keeps only the rule on acceptance (tests that need guesses verified every time).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.checks import ParamError
from tokenmill.sampling import SamplingParams

METHODS = ("ngram", "draft")
DRAFT_KV_CACHE_MEMORY = "128MiB"  # the draft engine's own KV pool, by default
MAX_REST = 64  # most decode steps a sequence waits after a fruitless verification
EMA = 0.3  # weight of the newest value in the moving averages (gain, step times)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates. k: most guesses per step (num_speculative_tokens);
    prompt_lookup_max/min: the n-gram lengths tried, longest first; max_running: no
    speculation while more sequences than this run; adaptive: rest a sequence whose
    verifications do not pay for their time (measured), not only one that accepts none.
    draft (method "draft"): the draft model's path or name; draft_kv_cache_memory: its
    KV pool."""

    method: str = "ngram"
    k: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    max_running: int = 4
    adaptive: bool = True
    draft: str | None = None
    draft_kv_cache_memory: str = DRAFT_KV_CACHE_MEMORY

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParamError.named(
                "speculative", f" method {self.method!r} is not one of {', '.join(METHODS)}"
            )
        for name in ("k", "prompt_lookup_max", "prompt_lookup_min", "max_running"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParamError.named(
                    "speculative", f" {name} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ParamError.named(
                "speculative",
                f" prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max "
                f"{self.prompt_lookup_max}",
            )
        if not isinstance(self.adaptive, bool):
            raise ParamError.named(
                "speculative", f" adaptive must be a bool, got {self.adaptive!r}"
            )
        if self.method == "draft" and not (isinstance(self.draft, str) and self.draft):
            raise ParamError.named(
                "speculative",
                " method 'draft' needs the draft model: draft:PATH or {'draft': PATH}",
            )
        if self.method != "draft" and self.draft is not None:
            raise ParamError.named(
                "speculative", f" a draft model is for method 'draft', not {self.method!r}"
            )

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """None (no speculation), a method name ("ngram", "draft:PATH"), a dict of the
        fields (vLLM's num_speculative_tokens is another name for k; {"draft": PATH} alone
        means method "draft"), or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = {"method": value}
        if not isinstance(value, dict):
            raise ParamError.named("speculative", " must be a method name or a dict")
        value = dict(value)
        if "num_speculative_tokens" in value:
            value["k"] = value.pop("num_speculative_tokens")
        method = value.get("method")
        if isinstance(method, str) and method.startswith("draft:"):  # the CLI's form
            value["method"], value["draft"] = "draft", method.removeprefix("draft:")
        elif "method" not in value and "draft" in value:
            value["method"] = "draft"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ParamError.named(
                "speculative",
                f" has no option {unknown[0]!r} (options: {', '.join(sorted(known))})",
            )
        return cls(**value)


@dataclass
class SpecState:
    """One sequence's speculation: its n-gram index and its acceptance."""

    k: int  # guesses to propose next time
    # n -> {n-gram: latest start i whose continuation token i + n already exists}
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # tokens whose n-grams are in the index (as starts' ends)
    rest: int = 0  # decode steps left without proposing
    misses: int = 0  # fruitless verifications in a row
    gain: float | None = None  # moving average of tokens per verification (accepted + 1)
    proposed: int = 0
    accepted: int = 0


class Speculator:
    """Proposes guesses for sequences and learns from what was accepted."""

    def __init__(self, config: SpeculativeConfig, draft=None):
        """draft: for method "draft", the draft model's LLMEngine (LLMEngine builds it)."""
        self.config = config
        self.draft = draft
        self.proposed = 0  # guesses verified, all sequences
        self.accepted = 0  # guesses accepted
        self.steps = 0  # verification steps (sequence-rows with guesses)
        # moving averages of the seconds of a step running one sequence alone
        self.plain_seconds: float | None = None  # a decode row
        self.verify_seconds: float | None = None  # a verification
        self.gain: float | None = None  # tokens per verification, all sequences (average)

    def state(self, seq) -> SpecState:
        if seq.spec is None:
            # a new sequence starts from what verifications have been worth so far: where
            # they have not paid, it rests at once (and tries again after MAX_REST steps)
            seq.spec = SpecState(k=self.config.k, gain=self.gain)
            cost = self.cost
            if self.config.adaptive and cost is not None and self.gain is not None:
                if self.gain < cost:
                    seq.spec.rest, seq.spec.misses = MAX_REST, MAX_REST.bit_length()
        return seq.spec

    def propose(self, seq, limit: int) -> list[int]:
        """Up to min(k, limit) guesses for what follows `seq`'s tokens ([] for none)."""
        st = self.state(seq)
        if st.rest > 0:
            st.rest -= 1
            return []
        k = min(st.k, limit)
        if k <= 0:
            return []
        if self.draft is not None:
            return self._draft_guesses(seq, k)
        tokens = seq.token_ids
        self._update_index(st, tokens)
        cfg = self.config
        for n in range(min(cfg.prompt_lookup_max, len(tokens) - 1), cfg.prompt_lookup_min - 1, -1):
            start = st.index.get(n, {}).get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    def _draft_guesses(self, seq, k: int) -> list[int]:
        """k greedy tokens of the draft model after `seq`'s tokens (fewer where its
        context ends). The request runs to its end on the draft engine, nothing else does."""
        draft, tokens = self.draft, list(seq.token_ids)
        k = min(k, draft.max_model_len - 1 - len(tokens))
        if k <= 0:
            return []
        request_id = f"draft-{seq.request_id}"
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        # under the sequence's own prefix-cache scope: the draft's cache must not tell one
        # user's timing about another's prompt either
        draft.add_request(request_id, tokens, params, cache_salt=seq.cache_salt)
        guesses: list[int] = []
        try:
            while draft.has_unfinished():
                for out in draft.step():
                    if out.error is not None:  # the draft failed: no guesses this time
                        return []
                    guesses.extend(out.token_ids)
        finally:
            if request_id in draft.requests:
                draft.abort(request_id)
        return guesses[:k]

    def _update_index(self, st: SpecState, tokens: list[int]) -> None:
        """Index every n-gram that has a continuation: starts i with i + n < len(tokens).
        Later starts overwrite earlier ones (the most recent occurrence wins)."""
        cfg = self.config
        for end in range(st.indexed, len(tokens) - 1):  # end: the n-gram's last token
            for n in range(cfg.prompt_lookup_min, cfg.prompt_lookup_max + 1):
                start = end - n + 1
                if start >= 0:
                    st.index.setdefault(n, {})[tuple(tokens[start : end + 1])] = start
        st.indexed = max(st.indexed, len(tokens) - 1)

    def record(self, seq, proposed: int, accepted: int) -> None:
        """A verification of `proposed` guesses accepted the first `accepted`: tune k."""
        st = self.state(seq)
        st.proposed += proposed
        st.accepted += accepted
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        if accepted == proposed:
            st.k = min(st.k + 2, self.config.k)
        else:
            st.k = max(st.k - 1, 1)
        tokens = accepted + 1
        st.gain = tokens if st.gain is None else (1 - EMA) * st.gain + EMA * tokens
        self.gain = tokens if self.gain is None else (1 - EMA) * self.gain + EMA * tokens
        cost = self.cost
        pays = not self.config.adaptive or cost is None or st.gain >= cost
        if accepted == 0 or not pays:
            st.misses += 1
            st.rest = min(2**st.misses, MAX_REST)
        else:
            st.misses = 0

    def observe(self, verification: bool, seconds: float) -> None:
        """The time of a step that ran one sequence alone: a verification or a decode row."""
        name = "verify_seconds" if verification else "plain_seconds"
        old = getattr(self, name)
        setattr(self, name, seconds if old is None else (1 - EMA) * old + EMA * seconds)

    @property
    def cost(self) -> float | None:
        """A verification step's time in plain decode steps (None until both are timed)."""
        if self.plain_seconds is None or self.verify_seconds is None:
            return None
        return self.verify_seconds / self.plain_seconds

    def stats(self) -> dict[str, int | float | str]:
        """Counters for kv_stats and /metrics: method, proposed, accepted, rate."""
        rate = self.accepted / self.proposed if self.proposed else 0.0
        return {
            "speculative_method": self.config.method,
            "speculative_steps": self.steps,
            "speculative_proposed_tokens": self.proposed,
            "speculative_accepted_tokens": self.accepted,
            "speculative_acceptance_rate": rate,
            "speculative_verify_cost": self.cost or 0.0,
        }
