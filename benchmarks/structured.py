"""What structured output costs: decode tokens/s of 8 concurrent requests, two ways.

    plain       8 unconstrained requests
    half        4 unconstrained + 4 held to a JSON Schema (grammar mask every step)

Every request decodes exactly --tokens tokens: the unconstrained ones ignore EOS and
the schema (an array of at least 20 objects) cannot be complete sooner, so both
variants run 8 rows for the same number of steps and the difference is the mask.
decode tok/s is 8 tokens over the median time of a decode step (the steps after every
request has its first token): a median over ~60 steps shrugs off the bursts of load a
shared machine has, which a total time does not. The variants run interleaved, round
after round, and each reports its median run, so drifting load hits both alike; the
ratio is half / plain within each round.

Inside the half runs the two grammar stages are timed: `allowed_tokens` (llguidance
fills the 4 rows' bitmasks, unpacked to bool) and `apply_token_mask` (-inf where not
allowed), per engine step. The first compilation of the schema (llguidance's token
table included) is timed once before the runs.

    .venv/bin/python benchmarks/structured.py [--runs 7] [--tokens 64] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling import SamplingParams
from tokenmill.sampling import grammar as grammar_module

ROWS, CONSTRAINED = 8, 4
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "minItems": 20,
}
QUESTIONS = [
    "List twenty people with their age and city, as JSON.",
    "Write a long story about a lighthouse keeper.",
    "Give me twenty famous scientists as JSON, with age and city.",
    "Explain how a steam engine works, step by step.",
    "Invent twenty characters for a novel, as JSON.",
    "Describe the history of Rome in detail.",
    "Make up twenty customers of a bakery, as JSON.",
    "Tell me everything about the ocean.",
]


class StageTimer:
    """Wraps the grammar module's stage functions and adds up their time per step."""

    def __init__(self) -> None:
        self.seconds = {"allowed_tokens": 0.0, "apply_token_mask": 0.0}
        self.calls = {"allowed_tokens": 0, "apply_token_mask": 0}
        self._originals: dict[str, Callable] = {}

    def __enter__(self) -> StageTimer:
        for name in self.seconds:
            original = getattr(grammar_module, name)
            self._originals[name] = original

            def timed(*args, _name=name, _f=original):
                t0 = time.perf_counter()
                try:
                    return _f(*args)
                finally:
                    self.seconds[_name] += time.perf_counter() - t0
                    self.calls[_name] += 1

            setattr(grammar_module, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(grammar_module, name, original)


def run_variant(engine: LLMEngine, constrained: int, tokens: int, tag: str) -> float:
    """Run the 8 requests together; returns decode tok/s (8 / median step time)."""
    prompts = [
        engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": f"{q} ({tag})"}]),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    for i, prompt in enumerate(prompts):
        if i % 2 == 0 and i // 2 < constrained:
            params = SamplingParams(max_tokens=tokens, temperature=0, json_schema=SCHEMA)
        else:
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    counts = dict.fromkeys((f"{tag}-{i}" for i in range(ROWS)), 0)
    steps: list[float] = []
    while engine.has_unfinished():
        decoding = all(counts.values())  # every request is past prefill and its first token
        t0 = time.perf_counter()
        outputs = engine.step()
        if decoding:
            steps.append(time.perf_counter() - t0)
        for out in outputs:
            counts[out.request_id] += len(out.token_ids)
    if any(n != tokens for n in counts.values()):
        raise RuntimeError(f"a request ended early: {counts}")
    return ROWS / statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    engine = LLMEngine(args.model, max_num_seqs=ROWS)
    print(engine.describe())

    t0 = time.perf_counter()
    engine.grammars.lltokenizer()
    table_s = time.perf_counter() - t0
    compiled = engine.grammars.compile("json_schema", SCHEMA)
    print(
        f"llguidance token table {table_s * 1000:.0f} ms (once per model), "
        f"schema compile {compiled.compile_ms:.1f} ms (once per distinct schema)"
    )

    variants = {"plain": 0, "half": CONSTRAINED}
    for name, constrained in variants.items():  # warm-up, and a check that both run
        run_variant(engine, constrained, 8, f"warm-{name}")
    results: dict[str, list[float]] = {name: [] for name in variants}
    mask_us: list[float] = []
    apply_us: list[float] = []
    for i in range(args.runs):
        results["plain"].append(run_variant(engine, 0, args.tokens, f"plain-{i}"))
        with StageTimer() as timer:
            rate = run_variant(engine, CONSTRAINED, args.tokens, f"half-{i}")
        results["half"].append(rate)
        mask_us.append(timer.seconds["allowed_tokens"] / timer.calls["allowed_tokens"] * 1e6)
        apply_us.append(timer.seconds["apply_token_mask"] / timer.calls["apply_token_mask"] * 1e6)
        print(
            f"round {i + 1}/{args.runs}: plain {results['plain'][-1]:.1f}  "
            f"half {rate:.1f} tok/s  (mask {mask_us[-1]:.0f} us + apply {apply_us[-1]:.0f} us "
            f"per step)"
        )

    ratios = [h / p for h, p in zip(results["half"], results["plain"], strict=True)]
    plain, half = statistics.median(results["plain"]), statistics.median(results["half"])
    step_ms = ROWS / half * 1000
    print(f"\ndecode tok/s, {ROWS} concurrent requests, median of {args.runs} runs:")
    print(f"  plain (8 unconstrained)         {plain:7.1f} tok/s")
    print(f"  half  (4 JSON Schema + 4 plain) {half:7.1f} tok/s")
    print(
        f"  ratio half/plain, paired by round: median {statistics.median(ratios):.3f} "
        f"(runs {min(ratios):.3f}..{max(ratios):.3f})"
    )
    mask, apply = statistics.median(mask_us), statistics.median(apply_us)
    print(
        f"  grammar stages per step (4 rows): masks {mask:.0f} us + apply {apply:.0f} us = "
        f"{(mask + apply) / 1000:.2f} ms of a {step_ms:.1f} ms step"
    )


if __name__ == "__main__":
    main()
