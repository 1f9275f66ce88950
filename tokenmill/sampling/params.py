"""Per-request sampling parameters, validated once at the API boundary.

Everything downstream (the batched sampler, stop logic, the server) trusts these
values, so every check happens here, in one place, with a one-line message that
names the parameter and its allowed range: a ParamError (a ValueError) whose `param`
is that parameter, and whose names the server respells as its request fields. A few
fields are normalised so that consumers have one spelling to handle: `stop` and
`stop_token_ids` become lists, `top_k == -1` becomes 0 ("off"), and logit_bias keys
become ints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.checks import ParamError
from tokenmill.checks import check_float as _check_float
from tokenmill.checks import check_int as _check_int
from tokenmill.sampling.dry import DEFAULT_BREAKERS

# The structured-output constraints (tokenmill/sampling/grammar.py compiles them); a
# request sets at most one.
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")
MAX_LOGPROBS = 20  # OpenAI's and vLLM's cap on top-N alternatives
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
MAX_STOP, MAX_STOP_CHARS = 64, 1000  # stop strings per request, characters per string
MAX_STOP_TOKEN_IDS = 1024
MAX_BREAKERS = 16  # DRY's sequence breakers per request
TOP_K_MAX = 2**31 - 1  # any k past the vocabulary is "off"; int64 tensors take this
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16  # >= 1
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1 = off (normalised to 0); else >= 1
    min_p: float = 0.0  # in [0, 1]
    # Locally typical sampling (Meister et al.; transformers' TypicalLogitsWarper, llama.cpp's
    # typical_p): keep the tokens whose surprisal is closest to the entropy, up to mass P
    typical_p: float = 1.0  # in (0, 1]; 1 = off
    # Top-n-sigma (Tang et al.; llama.cpp's top_n_sigma): keep the logits within n standard
    # deviations of the largest
    top_n_sigma: float = 0.0  # >= 0; 0 = off
    # XTC, "exclude top choices" (llama.cpp's xtc): with this probability per step, drop
    # every token at least xtc_threshold likely but the least likely of them
    xtc_probability: float = 0.0  # in [0, 1]; 0 = off
    xtc_threshold: float = 0.1  # in [0, 1]; above 0.5 it can never drop anything
    # Mirostat v2 (Basu et al.; llama.cpp's mirostat 2): keep the tokens whose surprise
    # -log2 p is at most mu, then move mu toward the target surprise tau by eta times the
    # drawn token's surprise error; mu starts at 2 tau
    mirostat: int = 0  # 0 = off, 2 = v2
    mirostat_tau: float = 5.0  # >= 0, bits
    mirostat_eta: float = 0.1  # >= 0
    # DRY (llama.cpp's dry; tokenmill/sampling/dry.py): subtract multiplier * base **
    # (n - allowed_length) from each token that would extend a run of n >= allowed_length
    # tokens repeated from the last penalty_last_n of the context (-1: all of it); a run
    # does not reach back across a sequence breaker
    dry_multiplier: float = 0.0  # >= 0; 0 = off
    dry_base: float = 1.75  # >= 1
    dry_allowed_length: int = 2  # >= 0
    dry_penalty_last_n: int = -1  # -1 = the whole context, 0 = off, else the last N tokens
    dry_sequence_breakers: list[str] | None = None  # None: DEFAULT_BREAKERS
    # HF/vLLM semantics: for tokens seen in prompt or output, divide positive logits
    # by the penalty and multiply negative ones.
    repetition_penalty: float = 1.0  # > 0
    # OpenAI semantics, over generated tokens only.
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    # token id -> bias in [-100, 100]; ids are checked against the vocab by
    # SamplingState.create. Decimal-string keys (the JSON wire form) become ints.
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    # None = no logprobs; 0 = the chosen token's only; N = plus top-N alternatives.
    logprobs: int | None = None
    n: int = 1  # number of completions
    # Structured output (at most one): the output must match it, token by token.
    json_schema: dict[str, Any] | bool | str | None = None  # a JSON Schema (str: its JSON)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar: Lark (llguidance's dialect) or GBNF
    # The reasoning format to split the output by (tokenmill/tokenizer/reasoning.py's, e.g.
    # "think"; the engine checks the name): stop strings and the constraint then apply to
    # the answer after the reasoning, and outputs carry the reasoning apart. None: off.
    reasoning: str | None = None

    def __post_init__(self) -> None:
        self.max_tokens = _check_int("max_tokens", self.max_tokens, 1)
        # Floats are checked as the float32 they become in the sampler's tensors: top_p
        # 1e-46 passes "> 0" in float64 and is 0 there (a 500 for every request in the
        # step).
        f32 = dict(float32=True)
        self.temperature = _check_float("temperature", self.temperature, 0.0, **f32)
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True, **f32)
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ParamError.named(
                "top_k", f" must be 0 or -1 (off) or an integer >= 1, got {self.top_k!r}"
            )
        # 0 = off; any k past the vocabulary keeps everything, so a k too big for an
        # int64 tensor (2**63) is clamped, not overflowed
        self.top_k = min(max(self.top_k, 0), TOP_K_MAX)
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0, **f32)
        self.typical_p = _check_float("typical_p", self.typical_p, 0.0, 1.0, lo_open=True, **f32)
        self.top_n_sigma = _check_float("top_n_sigma", self.top_n_sigma, 0.0, **f32)
        self.xtc_probability = _check_float(
            "xtc_probability", self.xtc_probability, 0.0, 1.0, **f32
        )
        self.xtc_threshold = _check_float("xtc_threshold", self.xtc_threshold, 0.0, 1.0, **f32)
        if self.mirostat not in (0, 2) or not _is_int(self.mirostat):
            raise ParamError.named(
                "mirostat", f" must be 0 (off) or 2 (Mirostat v2), got {self.mirostat!r}"
            )
        self.mirostat_tau = _check_float("mirostat_tau", self.mirostat_tau, 0.0, **f32)
        self.mirostat_eta = _check_float("mirostat_eta", self.mirostat_eta, 0.0, **f32)
        self.dry_multiplier = _check_float("dry_multiplier", self.dry_multiplier, 0.0, **f32)
        self.dry_base = _check_float("dry_base", self.dry_base, 1.0, **f32)
        self.dry_allowed_length = _check_int("dry_allowed_length", self.dry_allowed_length, 0)
        self.dry_penalty_last_n = _check_int("dry_penalty_last_n", self.dry_penalty_last_n, -1)
        self.dry_sequence_breakers = self._checked_breakers(self.dry_sequence_breakers)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, lo_open=True, **f32
        )
        self.presence_penalty = _check_float(
            "presence_penalty", self.presence_penalty, -2.0, 2.0, **f32
        )
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, -2.0, 2.0, **f32
        )
        self.logit_bias = self._checked_logit_bias(self.logit_bias)
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        self.stop = self._checked_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParamError.named(
                "stop_token_ids",
                f" must be a list of integers >= 0, got {self.stop_token_ids!r}",
            )
        elif len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError.named("stop_token_ids", f" takes at most {MAX_STOP_TOKEN_IDS} ids")
        else:
            self.stop_token_ids = [_check_int("stop_token_ids", t, 0) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, bool):
            raise ParamError.named("ignore_eos", f" must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self.n = _check_int("n", self.n, 1)
        if self.reasoning is not None and (
            not isinstance(self.reasoning, str) or not self.reasoning
        ):
            raise ParamError.named(
                "reasoning", f" must be a reasoning format's name or None, got {self.reasoning!r}"
            )
        self._check_constraint()

    @property
    def dry(self) -> bool:
        """Whether the DRY penalty is on."""
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def greedy(self) -> bool:
        """Whether the chosen token is always the argmax (no randomness involved).

        Like vLLM, temperatures below GREEDY_TEMPERATURE count as 0: dividing logits
        by them can overflow to inf, and the distribution is one-hot long before.
        """
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """(kind, value) of the structured-output constraint, kind in CONSTRAINTS; or None."""
        for kind in CONSTRAINTS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    def _check_constraint(self) -> None:
        """Types only: whether a schema or grammar compiles is decided by the grammar
        engine (LLMEngine.compile_grammar), which needs the tokenizer."""
        given = [kind for kind in CONSTRAINTS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ParamError.named(  # about two parameters: param None
                "",
                f"give at most one of {', '.join(CONSTRAINTS)}; got ",
                given[0],
                " and ",
                given[1],
            )
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ParamError.named("json_schema", f" is not valid JSON: {e}") from None
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise ParamError.named(
                "json_schema",
                f" must be a JSON Schema object, got {type(self.json_schema).__name__}",
            )
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ParamError.named(kind, f" must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise ParamError.named(
                    "choice", f" must be a non-empty list of non-empty strings, got {choice!r}"
                )
            self.choice = list(choice)
        if given and self.ignore_eos:
            # The grammar decides where the output ends; ignoring that end has no meaning.
            raise ParamError.named("ignore_eos", " cannot be combined with ", given[0])

    @staticmethod
    def _checked_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ParamError.named(
                "logit_bias", f" must be a dict of token id -> bias, got {bias!r}"
            )
        checked: dict[int, float] = {}
        for key, value in bias.items():
            # ASCII digits only: str.isdecimal() and int() also take other scripts' digits,
            # so "١٢" (Arabic-Indic) would silently become token 12.
            is_digits = isinstance(key, str) and key.isascii() and key.isdecimal()
            token = int(key) if is_digits else key
            if not _is_int(token) or token < 0:
                raise ParamError.named("logit_bias", f" keys must be token ids >= 0, got {key!r}")
            checked[token] = _check_float("logit_bias", value, -100.0, 100.0, at=f"[{token}]")
        return checked

    @staticmethod
    def _checked_breakers(breakers: Any) -> list[str]:
        if breakers is None:
            return list(DEFAULT_BREAKERS)
        if not isinstance(breakers, (list, tuple)) or not all(isinstance(s, str) for s in breakers):
            raise ParamError.named(
                "dry_sequence_breakers", f" must be a list of strings, got {breakers!r}"
            )
        if any(s == "" for s in breakers):
            raise ParamError.named("dry_sequence_breakers", " must not contain empty strings")
        # each breaker is looked for in every token's text once per vocabulary
        if len(breakers) > MAX_BREAKERS:
            raise ParamError.named(
                "dry_sequence_breakers",
                f" takes at most {MAX_BREAKERS} strings, got {len(breakers)}",
            )
        return list(breakers)

    @staticmethod
    def _checked_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise ParamError.named("stop", f" must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):
            raise ParamError.named("stop", " must not contain empty strings")
        # every stop string is searched in every new piece of text of every sequence:
        # 12,000 of them slowed every client's step by 40%
        if len(items) > MAX_STOP:
            raise ParamError.named("stop", f" takes at most {MAX_STOP} strings, got {len(items)}")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ParamError.named("stop", f" strings must be at most {MAX_STOP_CHARS} characters")
        return list(items)
