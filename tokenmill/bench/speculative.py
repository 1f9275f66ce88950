"""`tokenmill bench --speculative [ngram|draft:PATH]`: what speculative decoding gains on
text that repeats its input, and what it costs on text that does not, beside llama.cpp's
prompt lookup.

The tasks (PROMPTS, chat-templated where the model has a template): four input-grounded
ones whose answer repeats much of a 300-1,500-token input (add type hints to a Python
module, fix the typos in a passage, quote from a passage, rewrite a passage as a list),
and one free-text one (a story from one line). The inputs are tokenmill's own files, so
every copy of a version asks the same questions.

The engines, on the same weights, in this one process and on the same threads:
  tokenmill plain        no speculation;
  tokenmill <method>     speculative=<method> with k guesses (engine/speculative.py; the
                         default adaptive rule rests sequences whose guesses do not pay);
  llama.cpp plain        llama-cpp-python on the same GGUF (a .gguf model, when installed);
  llama.cpp lookup       the same with LlamaPromptLookupDecoding (n-grams up to 4 tokens,
                         k guesses: tokenmill's ngram settings).
Greedy decoding, up to `gen` tokens (an end-of-sequence token ends a run, as it would a
request). Each run, every task runs on every engine, the engines' order rotating run by
run, so a burst of load from other processes hits all alike. Decode tok/s is (tokens - 1)
/ (last token - first token): the prefill is left out, as speculation does not touch it.
A row gives the median over the runs, the ratio to the same engine's plain row, the
acceptance (guesses accepted / proposed), and whether its tokens equal the plain row's
(lossless speculation must; a verification's rounding can flip a near-tie, and the row
then says at which token the outputs part).

Then 16 requests at once (the tasks in turn), plain against speculating: generated tokens
per second of wall time, prefill included; the engine stops speculating while many
sequences run, so this must not fall.

Then the cost that decides whether a guess can pay: one step of T rows of one sequence
(its last token and T - 1 guesses, over 512 cached tokens, in the fused decode stack)
against a plain decode step, T = 1 .. k + 1 and 8, 16. benchmarks/speculative.py runs the
same code with the non-adaptive rule beside.
"""

from __future__ import annotations

import ast
import itertools
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import tokenmill
from tokenmill.bench.context import llama_cpp_installed

PACKAGE = Path(tokenmill.__file__).resolve().parent
FREE_TEXT = "free text"  # the task speculation cannot help: it must not slow it down
CONCURRENT = 16  # requests at once in the throughput rows


# ---------------------------------------------------------------------- the prompts


def _strip_hints(source: str) -> str:
    """A Python module with its annotations taken out (roughly: enough for the task)."""
    source = re.sub(r"\) -> [^:]+:", "):", source)
    return re.sub(r"(\w+): [\w\[\], .|]+( = |,|\))", r"\1\2", source)


def _typos(text: str) -> str:
    """Every seventh word with two letters swapped."""
    words = text.split(" ")
    for i in range(3, len(words), 7):
        w = words[i]
        if len(w) > 3 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def _passage() -> str:
    """Prose about the KV cache and scheduling: the engine modules' own docstrings."""
    parts = []
    for name in ("block_manager", "scheduler", "sequence"):
        source = (PACKAGE / "engine" / f"{name}.py").read_text()
        parts.append(ast.get_docstring(ast.parse(source)) or "")
    return "\n\n".join(parts)[:3000]


def prompts() -> dict[str, str]:
    """Task name -> the user's message."""
    module = _strip_hints((PACKAGE / "units.py").read_text())[:4000]
    passage = _passage()
    return {
        "type hints": "Add type hints to this Python module. Answer with the whole module."
        f"\n\n```python\n{module}\n```",
        "typos": f"Fix the typos in this text. Answer with the corrected text only.\n\n"
        f"{_typos(passage)}",
        "answer from passage": f"{passage}\n\nQuote, word for word, the first two "
        "paragraphs of the text above that talk about the KV cache.",
        "rewrite as list": f"{passage[:2000]}\n\nRewrite the text above as a bulleted list, "
        "one bullet per sentence, keeping each sentence's words.",
        FREE_TEXT: "Write a short story about a dragon who learns to bake bread.",
    }


def encode_tasks(engine, texts: dict[str, str]) -> dict[str, list[int]]:
    """Each task as the token ids a chat request would send (the model's chat template),
    or the plain text's ids for a model without one."""
    if getattr(engine.tokenizer, "chat_template", None):
        return {n: engine.encode_chat([{"role": "user", "content": t}]) for n, t in texts.items()}
    return {n: engine.encode_prompt(t) for n, t in texts.items()}


# ---------------------------------------------------------------------- the engines


class Run:
    """One engine's output of one task: decode tok/s, the tokens, and its guesses."""

    def __init__(self, rate: float, tokens: list[int], proposed: int, accepted: int):
        self.rate, self.tokens, self.proposed, self.accepted = rate, tokens, proposed, accepted


class TokenmillEngine:
    """tokenmill, plain (spec None) or speculating; greedy runs of up to `gen` tokens.
    method: the row's label ("plain", "ngram", "ngram adaptive=False", ...)."""

    engine_name = "tokenmill"

    def __init__(self, path: Path, spec: dict | None, gen: int, threads: int, dtype: str):
        from tokenmill import LLM, SamplingParams

        extra = {key: v for key, v in (spec or {}).items() if key not in ("method", "k")}
        self.method = spec["method"] if spec else "plain"
        self.method += "".join(f" {key}={v}" for key, v in extra.items())
        self.llm = LLM(path, dtype=dtype, threads=threads, speculative=spec)
        self.params = SamplingParams(max_tokens=gen, temperature=0)

    def run(self, ids: list[int]) -> Run:
        engine = self.llm.engine
        before = engine.speculative_stats()
        out = self.llm.generate([ids], self.params)[0]
        after = engine.speculative_stats()
        counts = [
            after.get(f"speculative_{key}_tokens", 0) - before.get(f"speculative_{key}_tokens", 0)
            for key in ("proposed", "accepted")
        ]
        return Run(out.timings.decode_tokens_per_s, list(out.token_ids), *counts)


class _CountingLookup:
    """LlamaPromptLookupDecoding that counts what it proposes (llama-cpp-python reports
    no acceptance): one call per verification step."""

    def __init__(self, k: int):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=k)
        self.calls = self.proposed = 0

    def __call__(self, input_ids, **kwargs):
        guesses = self.lookup(input_ids, **kwargs)
        self.calls += 1
        self.proposed += len(guesses)
        return guesses


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) on the same GGUF, plain or with prompt lookup."""

    engine_name = "llama.cpp"

    def __init__(self, path: Path, method: str, k: int, gen: int, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.method, self.gen = method, gen
        self.draft = _CountingLookup(k) if method == "lookup" else None
        self.llm = Llama(
            str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
            draft_model=self.draft, logits_all=self.draft is not None, verbose=False,
        )  # fmt: skip
        # logits_all spelled out: llama-cpp-python turns it on for a draft model but sizes
        # its logits buffer from the argument (n_batch rows), so a prompt past n_batch
        # tokens fails in eval
        self.eos = self.llm.token_eos()

    def run(self, ids: list[int]) -> Run:
        self.llm.reset()
        calls = self.draft.calls if self.draft else 0
        proposed = self.draft.proposed if self.draft else 0
        tokens: list[int] = []
        first = end = time.perf_counter()
        for token in self.llm.generate(list(ids), temp=0.0, top_k=1, reset=True):
            end = time.perf_counter()
            if not tokens:
                first = end
            tokens.append(token)
            if token == self.eos or len(tokens) == self.gen:
                break
        rate = (len(tokens) - 1) / (end - first) if end > first else 0.0
        if self.draft is None:
            return Run(rate, tokens, 0, 0)
        # a verification step emits its accepted guesses and one token of its own; the
        # first call follows the prompt's step, which emitted the first token alone
        steps = self.draft.calls - calls
        accepted = max(0, len(tokens) - steps)
        return Run(rate, tokens, self.draft.proposed - proposed, accepted)


# ---------------------------------------------------------------------- the run


def _parts_at(a: list[int], b: list[int]) -> int | None:
    """The first index where two outputs differ (None: the same tokens)."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def speculative_rows(
    path: Path,
    *,
    methods: list[str | dict],
    k: int,
    runs: int,
    gen: int,
    threads: int,
    dtype: str = "float32",
    llama_cpp: bool = True,
    concurrent: int = CONCURRENT,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict], TokenmillEngine]:
    """One row per (task, engine, method): {task, prompt_tokens, engine, method,
    decode_tok_s, rates, tokens, proposed, accepted, acceptance, vs_plain, parts_at}.
    methods: tokenmill's speculative= values beside plain ("ngram", "draft:PATH", or a
    dict such as {"method": "ngram", "adaptive": False}). Returns the rows and the plain
    tokenmill engine (for verify_cost)."""
    log("loading tokenmill plain")
    plain = TokenmillEngine(path, None, gen, threads, dtype)
    engines: list = [plain]
    for method in methods:
        log(f"loading tokenmill, speculative={method}")
        spec = {"k": k, **method} if isinstance(method, dict) else {"method": method, "k": k}
        engines.append(TokenmillEngine(path, spec, gen, threads, dtype))
    tasks = encode_tasks(plain.llm.engine, prompts())
    window = plain.llm.engine.max_model_len
    longest = max(map(len, tasks.values())) + gen
    if longest > window:
        raise ValueError(
            f"the longest task needs {longest} tokens: more than the model's context of {window}"
        )
    if llama_cpp and path.suffix == ".gguf" and llama_cpp_installed():
        for method in ("plain", "lookup"):
            log(f"loading llama.cpp {method}")
            engines.append(LlamaCppEngine(path, method, k, gen, threads, longest + 64))
    got: dict[tuple[str, int], list[Run]] = {(t, j): [] for t in tasks for j in range(len(engines))}
    for engine in engines:  # the warm-up, not counted: every path once
        engine.run(tasks[FREE_TEXT][:32])
    for r in range(runs):
        log(f"run {r + 1} of {runs}")
        order = list(range(len(engines)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for task, ids in tasks.items():
            for j in order:
                got[task, j].append(engines[j].run(ids))
    rows = []
    for task, ids in tasks.items():
        medians = {j: statistics.median(x.rate for x in got[task, j]) for j in range(len(engines))}
        for j, engine in enumerate(engines):
            base = next(  # the same engine's plain row
                i
                for i, e in enumerate(engines)
                if e.engine_name == engine.engine_name and e.method == "plain"
            )
            runs_j = got[task, j]
            proposed = sum(x.proposed for x in runs_j)
            accepted = sum(x.accepted for x in runs_j)
            rows.append(
                {
                    "task": task,
                    "prompt_tokens": len(ids),
                    "engine": engine.engine_name,
                    "method": engine.method,
                    "decode_tok_s": medians[j],
                    "rates": [x.rate for x in runs_j],
                    "tokens": len(runs_j[-1].tokens),
                    "proposed": proposed,
                    "accepted": accepted,
                    "acceptance": accepted / proposed if proposed else None,
                    "vs_plain": medians[j] / medians[base] if medians[base] else None,
                    "parts_at": _parts_at(runs_j[-1].tokens, got[task, base][-1].tokens),
                }
            )
    if concurrent:
        rows += concurrent_rows([e for e in engines if isinstance(e, TokenmillEngine)],
                                tasks, concurrent, runs, log)  # fmt: skip
    return rows, plain


def concurrent_rows(
    engines: list[TokenmillEngine],
    tasks: dict[str, list[int]],
    n: int,
    runs: int,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict]:
    """n requests at once (the tasks in turn), per engine: generated tokens per second
    of wall time from the first request in to the last token out (prefill included),
    median over the runs, and how many outputs differ from plain's. Speculation must not
    cost throughput here: the engine stops speculating while many sequences run."""
    batch = [ids for _, ids in zip(range(n), itertools.cycle(tasks.values()), strict=False)]
    rates: list[list[float]] = [[] for _ in engines]
    outputs: list[list[list[int]]] = [[] for _ in engines]
    guesses = [{"proposed": 0, "accepted": 0} for _ in engines]
    for r in range(runs):
        log(f"{n} requests at once, run {r + 1} of {runs}")
        order = list(range(len(engines)))
        for j in order[r % len(order) :] + order[: r % len(order)]:
            before = engines[j].llm.engine.speculative_stats()
            start = time.perf_counter()
            outs = engines[j].llm.generate(batch, engines[j].params)
            wall = time.perf_counter() - start
            after = engines[j].llm.engine.speculative_stats()
            for key in ("proposed", "accepted"):
                name = f"speculative_{key}_tokens"
                guesses[j][key] += after.get(name, 0) - before.get(name, 0)
            outputs[j] = [list(o.token_ids) for o in outs]
            rates[j].append(sum(map(len, outputs[j])) / wall)
    medians = [statistics.median(v) for v in rates]
    rows = []
    for j, engine in enumerate(engines):
        differ = sum(a != b for a, b in zip(outputs[j], outputs[0], strict=True))
        rows.append(
            {
                "task": f"{n} at once",
                "prompt_tokens": sum(map(len, batch)),
                "engine": engine.engine_name,
                "method": engine.method,
                "decode_tok_s": medians[j],
                "rates": rates[j],
                "tokens": sum(map(len, outputs[j])),
                **guesses[j],
                "acceptance": guesses[j]["accepted"] / guesses[j]["proposed"]
                if guesses[j]["proposed"]
                else None,
                "vs_plain": medians[j] / medians[0] if medians[0] else None,
                "parts_at": None,
                "outputs_differing": differ,
            }
        )
    return rows


# ---------------------------------------------------------------------- a step's cost


def verify_cost(llm, ts: list[int], context: int = 512, reps: int = 10) -> dict[int, list[float]]:
    """Seconds of each of `reps` steps of T rows of one sequence over `context` cached
    tokens, per T in ts (T = 1: a plain decode step; the T values take turns within each
    round, so all see the same load)."""
    from tokenmill import SamplingParams
    from tokenmill.engine.scheduler import ScheduledChunk

    engine = llm.engine
    ids = [1000 + i % 20000 for i in range(context)]
    engine.add_request("cost", ids, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    seq = engine.requests["cost"].seq
    while seq.num_computed < context:  # the prompt; one token sampled, uncomputed
        engine.step()
    engine.blocks.grow(seq.block_table, seq.num_computed + max(ts))
    chunks = {t: ScheduledChunk(seq, t, tuple(range(2000, 2000 + t - 1))) for t in ts}
    times: dict[int, list[float]] = {t: [] for t in ts}
    try:
        for _ in range(reps):
            for t, chunk in chunks.items():
                start = time.perf_counter()
                engine.runner.run([chunk])
                times[t].append(time.perf_counter() - start)
    finally:
        engine.abort("cost")
    return times


def cost_lines(cost: dict[int, list[float]]) -> list[str]:
    """The cost curve as text: median and fastest ms per T, each against T = 1."""
    med = {t: statistics.median(v) for t, v in cost.items()}
    low = {t: min(v) for t, v in cost.items()}
    return [
        f"  T={t:2} {med[t] * 1e3:6.1f} ms ({med[t] / med[1]:.2f}x)  fastest "
        f"{low[t] * 1e3:6.1f} ms ({low[t] / low[1]:.2f}x)"
        for t in cost
    ]


# ---------------------------------------------------------------------- the table


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table: per task, each engine's decode tok/s, its ratio to
    the same engine's plain row, the guesses accepted, and whether the output is plain's."""
    lines = [
        "| task | prompt tokens | engine | method | decode tok/s | vs plain | accepted / proposed | output |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        accepted = "-"
        if r["proposed"]:
            accepted = f"{r['accepted']}/{r['proposed']} ({r['acceptance']:.0%})"
        if r["method"] == "plain":
            output = f"{r['tokens']} tokens"
        elif r.get("outputs_differing"):
            output = f"{r['outputs_differing']} outputs differ from plain's"
        elif r["parts_at"] is None:
            output = "= plain"
        else:
            output = f"parts from plain at token {r['parts_at']}"
        lines.append(
            f"| {r['task']} | {r['prompt_tokens']} | {r['engine']} | {r['method']} | "
            f"{r['decode_tok_s']:.1f} | {r['vs_plain']:.2f}x | {accepted} | {output} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per engine and method: the geometric mean of vs_plain over the input-grounded
    tasks, vs_plain on free text and with many requests at once (the issue's >= 1.5x,
    >= 0.97x and >= 0.97x)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["method"] == "plain":
            continue
        entry = out.setdefault(f"{r['engine']} {r['method']}", {"grounded": []})
        if r["task"] == FREE_TEXT:
            entry[FREE_TEXT] = r["vs_plain"]
        elif "outputs_differing" in r:
            entry["concurrent"] = r["vs_plain"]
        else:
            entry["grounded"].append(r["vs_plain"])
    for entry in out.values():
        ratios = entry["grounded"]
        entry["grounded"] = statistics.geometric_mean(ratios) if ratios else None
    return out


def cmd_speculative(args, path: Path, threads: int, log: Callable[[str], None]) -> dict:
    """`tokenmill bench --speculative`: the rows, their table and the cost curve (printed),
    as a report."""
    peers = getattr(args, "peers", None)
    with_llama = peers is None or "llamacpp" in peers
    if with_llama and path.suffix == ".gguf" and not llama_cpp_installed():
        log("llama.cpp: not installed (pip install llama-cpp-python); tokenmill alone")
    k = args.num_speculative_tokens
    rows, plain = speculative_rows(
        path, methods=[args.speculative], k=k, runs=args.runs, gen=args.gen_len,
        threads=threads, dtype=args.dtype, llama_cpp=with_llama, log=log,
    )  # fmt: skip
    from tokenmill.bench.machine import cpu_name

    print(
        f"{cpu_name()}, {threads} threads, greedy, up to {args.gen_len} tokens, median of {args.runs}:"
    )
    print(markdown_table(rows))
    totals = summary(rows)
    for key, entry in totals.items():
        shown = {
            k: "-" if entry.get(k) is None else f"{entry[k]:.2f}x"
            for k in ("grounded", FREE_TEXT, "concurrent")
        }
        print(
            f"{key}: input-grounded tasks {shown['grounded']} of plain (geometric mean), "
            f"free text {shown[FREE_TEXT]}, {CONCURRENT} at once {shown['concurrent']}"
        )
    ts = sorted({*range(1, k + 2), 8, 16})
    log("the cost of a verification step of T rows")
    cost = verify_cost(plain.llm, ts, reps=max(5, 2 * args.runs))
    print("a step of T rows of one sequence over 512 cached tokens (T = 1: a plain decode step):")
    print("\n".join(cost_lines(cost)))
    return {
        "speculative": rows,
        "summary": totals,
        "cost": {str(t): v for t, v in cost.items()},
        "settings": {
            "cpu": cpu_name(),
            "method": args.speculative,
            "k": k,
            "runs": args.runs,
            "gen_len": args.gen_len,
            "threads": threads,
        },
    }
