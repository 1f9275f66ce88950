"""`tokenmill bench --embeddings`: embedding throughput, tokenmill beside llama.cpp.

Inputs per second at 32 and 512 tokens an input: tokenmill's
`LLM.embed` and llama-cpp-python's embedding mode (`Llama(..., embedding=True).embed`) on
the same GGUF file, the same texts and the same number of threads, as a ratio of medians.

    texts     N distinct texts per length (N = INPUTS[L]: 64 of 32 tokens, 16 of 512;
              with --quick 16 and 4),
              random common words, each exactly L tokens under the model's tokenizer
              (special tokens included, as LLM.embed counts them); llama.cpp tokenizes the
              same text from the GGUF's vocabulary, and the tokens it saw are reported.
    a run     one call embedding all N texts, timed; a warm-up run per length, then --runs
              runs, the engines alternating run by run (a burst of load from others on a
              shared machine hits both alike). inputs/s = N / the median run's seconds.
    settings  both at their defaults for batching: tokenmill's 512-token step budget
              (max_num_batched_tokens), llama.cpp's n_batch 512 (its embed packs whole
              inputs into batches of at most n_batch tokens); last-token pooling,
              L2-normalized, on both (tokenmill's default without sentence-transformers
              files; llama.cpp's pooling_type LAST); tokenmill's prefix cache off, so
              every run computes every token.
    check     the cosine between the two engines' vectors of the same first text at each
              length: the same computation, on the same weights (reported, near 1).

Each engine runs in its own subprocess (python -m tokenmill.bench.embeddings ENGINE SPEC),
driven through engines.Worker's wire (protocol.reply): it loads, replies with its facts,
then answers `embed L` with {"seconds", "tokens", "first"} and `exit` with its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.bench.engines import Worker, WorkerError, log, resolve_peers
from tokenmill.bench.protocol import peak_rss_bytes, reply

LENGTHS = (32, 512)  # tokens an input
INPUTS = {32: 64, 512: 16}  # inputs embedded by one timed run, per length
QUICK_INPUTS = {32: 16, 512: 4}  # with --quick
BATCH_TOKENS = 512  # both engines' default batch: tokenmill's step budget, llama.cpp's n_batch
PEER = "llamacpp"  # the one peer with an embedding mode here

# common English words: text a tokenizer splits as it splits prose
WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which "
    "this be or has had not but their one all also they new after first two its who been "
    "other more time when during between into over city year state world people school "
    "river house water light small great music family early history found later known "
    "under while many since most three where game local power north south work public"
).split()


@dataclass
class EmbedWorkload:
    """What a worker needs: the model, its threads, and the texts by length ("32": [...])."""

    model: str
    threads: int
    texts: dict[str, list[str]]


def text_of_length(count, length: int, rng: random.Random) -> str:
    """A text of random words that `count` (text -> tokens) makes exactly `length` tokens:
    the longest run of words within it, then single-letter words (one token each in the
    vocabularies of the BPE models tokenmill runs) to make up the rest."""
    words = [rng.choice(WORDS) for _ in range(length)]  # >= 1 token a word: enough
    lo, hi = 0, len(words)  # the most words whose text is at most `length` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= length:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    for _ in range(2 * length):
        n = count(text)
        if n == length:
            return text
        if n > length:  # a filler merged with its neighbour the wrong way: drop a word
            text = text.rsplit(" ", 1)[0]
        else:
            text += " " + rng.choice("abcdefghijklmnopqrstuvwxyz")
    raise RuntimeError(f"could not make a text of exactly {length} tokens")


def make_texts(count, lengths: tuple[int, ...], inputs: dict[int, int], seed: int = 0):
    """{str(L): INPUTS[L] distinct texts of exactly L tokens} (seeded: the same every run)."""
    rng = random.Random(seed)
    return {str(n): [text_of_length(count, n, rng) for _ in range(inputs[n])] for n in lengths}


# ---------------------------------------------------------------------- the workers


class TokenmillEmbedder:
    def __init__(self, work: EmbedWorkload):
        from tokenmill import kernels
        from tokenmill.llm import LLM

        start = time.perf_counter()
        longest = max(int(n) for n in work.texts)
        self.llm = LLM(
            work.model,
            threads=work.threads,
            enable_prefix_caching=False,  # every run computes every token
            max_num_batched_tokens=max(BATCH_TOKENS, longest),
        )
        self.info = {"load_s": time.perf_counter() - start, "kernels": kernels.isa()}

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """The vectors, and the tokens the engine computed for them."""
        engine = self.llm.engine
        before = engine.stats["prompt_tokens"]
        vectors = self.llm.embed(texts)
        return vectors, engine.stats["prompt_tokens"] - before


class LlamaCppEmbedder:
    def __init__(self, work: EmbedWorkload):
        import llama_cpp
        import llama_cpp.llama_cpp as low

        start = time.perf_counter()
        longest = max(int(n) for n in work.texts)
        batch = max(BATCH_TOKENS, longest)
        # Llama.embed packs several inputs into one batch as sequences 0, 1, ..., but
        # Llama() leaves llama.cpp's n_seq_max at 1, so a batch of two inputs fails
        # (llama_decode -1). Its context params are made with as many sequences as a batch
        # can hold inputs (kv_unified: one KV cache shared by them).
        seqs = max(1, batch // min(int(n) for n in work.texts))
        defaults = low.llama_context_default_params

        def params():
            p = defaults()
            p.n_seq_max, p.kv_unified = seqs, True
            return p

        low.llama_context_default_params = params
        try:
            self.llm = llama_cpp.Llama(
                model_path=work.model,
                embedding=True,
                pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST,  # as tokenmill pools
                # room for the longest input in every sequence (llama.cpp gives each
                # n_ctx / n_seq_max where the cache is not unified); cleared every batch
                n_ctx=seqs * longest,
                n_batch=batch,
                n_ubatch=batch,
                n_threads=work.threads,
                n_threads_batch=work.threads,
                verbose=False,
            )
        finally:
            low.llama_context_default_params = defaults
        self.info = {
            "load_s": time.perf_counter() - start,
            "version": getattr(llama_cpp, "__version__", "?"),
            "notes": [f"n_batch {batch}, n_seq_max {seqs}, n_ctx {seqs * longest}, pooling LAST"],
        }

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        return self.llm.embed(texts, normalize=True, return_count=True)


EMBEDDERS = {"tokenmill": TokenmillEmbedder, PEER: LlamaCppEmbedder}


def worker(argv: list[str]) -> None:
    """A worker process: load ENGINE on SPEC's model, then answer commands until `exit`."""
    if len(argv) != 2 or argv[0] not in EMBEDDERS:
        sys.exit(f"usage: python -m tokenmill.bench.embeddings {{{','.join(EMBEDDERS)}}} SPEC")
    work = EmbedWorkload(**json.loads(Path(argv[1]).read_text()))
    embedder = EMBEDDERS[argv[0]](work)
    reply(embedder.info)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "embed":
            texts = work.texts[arg]
            start = time.perf_counter()
            vectors, tokens = embedder.embed(texts)
            seconds = time.perf_counter() - start
            if len(vectors) != len(texts):
                raise RuntimeError(f"{len(vectors)} vectors for {len(texts)} texts")
            reply({"seconds": seconds, "tokens": tokens, "first": list(vectors[0])})
        elif command == "exit":
            reply({"peak_rss_bytes": peak_rss_bytes()})
            return


class EmbedWorker(Worker):
    """engines.Worker's driving, started on this module's worker."""

    def __init__(self, name: str, spec: Path):
        cmd = [sys.executable, "-m", "tokenmill.bench.embeddings", name, str(spec)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.last_line = ""


# ---------------------------------------------------------------------- the run


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def measure(
    model: Path,
    threads: int,
    runs: int,
    peers: list[str],
    lengths: tuple[int, ...] = LENGTHS,
    inputs: dict[int, int] | None = None,
) -> dict:
    """The embeddings report: per length, each engine's runs, inputs/s and tokens/s of the
    median run, and the ratio tokenmill / llama.cpp; engines that could not run, with why."""
    from tokenmill.engine.llm_engine import load_tokenizer

    inputs = inputs or INPUTS
    tokenizer = load_tokenizer(model)
    texts = make_texts(
        lambda text: len(tokenizer.encode(text, add_special_tokens=True)), lengths, inputs
    )
    work = EmbedWorkload(model=str(model), threads=threads, texts=texts)
    names = ["tokenmill", *peers]
    engines: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        spec = Path(tmp) / "embeddings.json"
        spec.write_text(json.dumps(asdict(work)))
        workers: dict[str, EmbedWorker] = {}
        try:
            for name in names:
                log(f"loading {name} (embeddings)")
                workers[name] = EmbedWorker(name, spec)
                _ask(workers, engines, name, None)
            firsts: dict[str, dict[str, list[float]]] = {}
            for n in map(str, lengths):
                for r in range(runs + 1):  # round 0: the warm-up
                    order = list(workers)
                    k = r % max(1, len(order))
                    for name in order[k:] + order[:k]:
                        sample = _ask(workers, engines, name, f"embed {n}")
                        if sample is None or r == 0:
                            continue
                        firsts.setdefault(name, {})[n] = sample.pop("first")
                        engines[name].setdefault("runs", {}).setdefault(n, []).append(sample)
                        log(
                            f"{name} {n} tokens run {r}/{runs}: "
                            f"{len(texts[n]) / sample['seconds']:.3g} inputs/s"
                        )
            for name in list(workers):
                if (done := _ask(workers, engines, name, "exit")) is not None:
                    engines[name].update(done)
        finally:
            for w in workers.values():
                w.close()
    return _report(work, runs, engines, firsts)


def _ask(workers: dict, engines: dict, name: str, command: str | None) -> dict | None:
    """The worker's reply (None: its first, the facts), or None once it has died (the
    engine is then marked failed and the others go on)."""
    w = workers.get(name)
    if w is None:
        return None
    try:
        answer = w.read() if command is None else w.call(command)
    except WorkerError as e:
        w.close()
        del workers[name]
        engines[name] = {"status": "failed", "reason": str(e)}
        log(f"{name} failed: {e}")
        return None
    if command is None:
        engines[name] = {"status": "ok", **answer}
    return answer


def _report(work: EmbedWorkload, runs: int, engines: dict, firsts: dict) -> dict:
    from tokenmill.bench.machine import cpu_name  # torch: the parent's, not a worker's

    lengths: dict[str, dict] = {}
    for n, texts in work.texts.items():
        row: dict = {"inputs": len(texts), "tokens_per_input": int(n)}
        for name, raw in engines.items():
            samples = raw.get("runs", {}).get(n)
            if not samples:
                continue
            seconds = statistics.median(s["seconds"] for s in samples)
            row[name] = {
                "inputs_per_s": len(texts) / seconds,
                "tokens_per_s": statistics.median(s["tokens"] for s in samples) / seconds,
                "tokens_per_input": samples[0]["tokens"] / len(texts),
                "runs_s": [s["seconds"] for s in samples],
            }
        if "tokenmill" in row and PEER in row:
            row["ratio"] = row["tokenmill"]["inputs_per_s"] / row[PEER]["inputs_per_s"]
            row["cosine"] = cosine(firsts["tokenmill"][n], firsts[PEER][n])
        lengths[n] = row
    return {
        "model": work.model,
        "threads": work.threads,
        "cpu": cpu_name(),
        "runs": runs,
        "batch_tokens": BATCH_TOKENS,
        "engines": {
            name: {k: v for k, v in raw.items() if k != "runs"} for name, raw in engines.items()
        },
        "lengths": lengths,
    }


def render(report: dict):
    """A rich table: per length, each engine's inputs/s (tokens/s) and the ratio."""
    from rich.table import Table

    table = Table(
        title=f"embeddings: inputs/s, median of {report['runs']} runs, {report['threads']} "
        f"threads, {report['cpu']}"
    )
    for column in ("tokens/input", "inputs/run", "tokenmill", "llama.cpp", "ratio", "cosine"):
        table.add_column(column, justify="right")
    for n, row in report["lengths"].items():
        cells = [n, str(row["inputs"])]
        for name in ("tokenmill", PEER):
            r = row.get(name)
            cells.append(f"{r['inputs_per_s']:.3g} ({r['tokens_per_s']:.0f} tok/s)" if r else "-")
        cells.append(f"{row['ratio']:.2f}x" if "ratio" in row else "-")
        cells.append(f"{row['cosine']:.4f}" if "cosine" in row else "-")
        table.add_row(*cells)
    for name, raw in report["engines"].items():
        if raw.get("status") != "ok":
            table.caption = f"{name}: {raw.get('status')}: {raw.get('reason')}"
    return table


def cmd_embeddings(args: argparse.Namespace) -> None:
    """`tokenmill bench --embeddings`: measure, print the table, write --json."""
    from rich.console import Console

    from tokenmill.engine.llm_engine import resolve_model

    path = resolve_model(args.model)
    threads = args.threads or os.cpu_count() or 1
    wanted = [PEER] if PEER in args.peers else []
    peers, skipped = resolve_peers(wanted, args.install_peers, path)
    load_before = os.getloadavg()  # others' work on a shared machine, as the full run notes
    report = measure(path, threads, args.runs, peers, inputs=QUICK_INPUTS if args.quick else None)
    report["engines"].update(skipped)
    report["load_average_before"], report["load_average_after"] = load_before, os.getloadavg()
    Console(width=max(Console().width, 120)).print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"report written to {args.json}")


if __name__ == "__main__":
    worker(sys.argv[1:])
