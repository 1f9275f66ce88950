"""Decode beside a busy neighbour: tokenmill and llama.cpp with all cores and with one
thread, on a quiet machine and beside processes that each keep one core busy.

    python benchmarks/contention.py [--model M] [--rounds 5] [--busy 1] [--pin]
        [--gen-len 128] [--prompt-len 32] [--peers llamacpp|none] [--json PATH]

Why: a parallel region waits for its slowest thread, so when the OS deschedules one
decode thread to run the neighbour, every barrier of the step waits for it (issue 21,
item 16: 2 threads fell from 290 to 85-99 tok/s beside one busy core, below one thread's
165-170). tokenmill's kernels shrink their thread team after such a stall and try the
whole team again later (tokenmill/kernels/team.c); `tokenmill fixed team` is the same
build with that off (TOKENMILL_ADAPTIVE_THREADS=0), the behaviour before.

Every engine runs in its own worker process (the ones `tokenmill bench` uses), loaded
once, on the same prompt ids (the bench's latency prompt, --prompt-len tokens) and the
same greedy --gen-len tokens. Each round measures every engine quiet, then starts the
neighbours (`--busy` pure-Python loops, pinned to cores 0.. with --pin, else placed by
the OS), measures every engine again and stops them; the order of the engines rotates
from round to round. Decode tok/s is (tokens - 1) / (last token - first token); the
table shows medians over the rounds, and the ratios are of those medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench.engines import SETTLE_S as BETWEEN_RUNS_S
from tokenmill.bench.engines import Worker, WorkerError
from tokenmill.bench.protocol import Workload, latency_prompt

BUSY_LOOP = "while True:\n    pass\n"
SETTLE_S = 0.5  # after starting the neighbours, before the first timed run


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model name or path [the default model]")
    p.add_argument("--rounds", type=int, default=5, help="rounds (medians over them)")
    p.add_argument("--busy", type=int, default=1, help="busy neighbour processes")
    p.add_argument("--pin", action="store_true", help="pin neighbour i to core i")
    p.add_argument("--threads", type=int, default=None, help="the default threads [all cores]")
    p.add_argument("--gen-len", type=int, default=128, help="greedy tokens per run")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per run")
    p.add_argument("--peers", default="llamacpp", choices=["llamacpp", "none"])
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the workers and neighbours at this niceness (e.g. -10 as root: other "
        "processes on a shared machine then take ~10%% of what they would)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write every run as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.busy < 0 or args.gen_len < 2 or args.prompt_len < 1:
        p.error("--rounds >= 1, --busy >= 0, --gen-len >= 2 and --prompt-len >= 1")
    return args


@contextlib.contextmanager
def neighbours(count: int, pin: bool):
    """`count` processes spinning in a Python loop for as long as the block runs."""
    procs = []
    try:
        for i in range(count):
            proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
            if pin:
                os.sched_setaffinity(proc.pid, {i % (os.cpu_count() or 1)})
            procs.append(proc)
        time.sleep(SETTLE_S if count else 0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def start_worker(engine: str, spec: Path, env: dict[str, str]) -> Worker:
    """A bench worker whose process sees `env` on top of this one's environment."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Worker(engine, spec)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str]) -> None:
    from tokenmill.engine.llm_engine import load_tokenizer, resolve_model

    args = parse_args(argv)
    if args.nice:
        os.nice(args.nice)  # the workers and the neighbours inherit it
    path = resolve_model(args.model)
    cores = os.cpu_count() or 1
    threads = args.threads or cores
    prompt = latency_prompt(load_tokenizer(path), args.prompt_len)
    # name -> (worker kind, threads, environment)
    configs = {
        f"tokenmill, {threads} threads": ("tokenmill", threads, {}),
        f"tokenmill, {threads} threads, fixed team": (
            "tokenmill",
            threads,
            {"TOKENMILL_ADAPTIVE_THREADS": "0"},
        ),
        "tokenmill, 1 thread": ("tokenmill", 1, {}),
    }
    if args.peers == "llamacpp":
        if path.suffix != ".gguf":
            raise SystemExit("llama.cpp needs a .gguf model (or --peers none)")
        configs[f"llama.cpp, {threads} threads"] = ("llamacpp", threads, {})
        configs["llama.cpp, 1 thread"] = ("llamacpp", 1, {})
    load_before = os.getloadavg()
    runs: dict[str, dict[str, list[float]]] = {n: {"quiet": [], "busy": []} for n in configs}
    ttfts: dict[str, dict[str, list[float]]] = {n: {"quiet": [], "busy": []} for n in configs}
    with tempfile.TemporaryDirectory(prefix="tokenmill-contention-") as tmp:
        workers: dict[str, Worker] = {}
        try:
            for name, (engine, n, env) in configs.items():
                spec = Path(tmp) / f"{engine}-{n}.json"
                work = Workload(
                    model=str(path),
                    dtype="float32",
                    threads=n,
                    runs=args.rounds,
                    gen_len=args.gen_len,
                    latency_prompts={"p": prompt},
                    requests=[],
                    skip=["throughput"],
                    kv_cache_memory=None,
                    peer_batch_size=1,
                )
                spec.write_text(json.dumps(asdict(work)))
                print(f"contention: loading {name}", file=sys.stderr, flush=True)
                workers[name] = start_worker(engine, spec, env)
                workers[name].read()  # its facts after loading
                workers[name].call("latency p")  # warm-up
            for r in range(args.rounds):
                names = list(workers)
                order = names[r % len(names) :] + names[: r % len(names)]
                for phase, count in (("quiet", 0), ("busy", args.busy)):
                    with neighbours(count, args.pin):
                        for name in order:
                            time.sleep(BETWEEN_RUNS_S)  # the last engine's threads spin down
                            s = workers[name].call("latency p")
                            tps = (s["output_tokens"] - 1) / s["decode_s"]
                            runs[name][phase].append(tps)
                            ttfts[name][phase].append(s["ttft_s"] * 1000)
                            print(
                                f"contention: round {r + 1}/{args.rounds} {phase:5} "
                                f"{name}: {tps:.1f} tok/s, first token {s['ttft_s'] * 1000:.0f} ms",
                                file=sys.stderr,
                                flush=True,
                            )
        except WorkerError as e:
            raise SystemExit(f"contention: a worker died: {e}") from None
        finally:
            for worker in workers.values():
                worker.close()
    load_after = os.getloadavg()
    report(args, path, threads, runs, ttfts, load_before, load_after)


def report(args, path: Path, threads: int, runs, ttfts, load_before, load_after) -> None:
    med = {n: {ph: statistics.median(v) for ph, v in r.items()} for n, r in runs.items()}
    ttft = {n: {ph: statistics.median(v) for ph, v in r.items()} for n, r in ttfts.items()}
    own_one = med["tokenmill, 1 thread"]["busy"]
    own_one_ttft = ttft["tokenmill, 1 thread"]["busy"]
    print(
        f"\nmodel {path.name}, prompt {args.prompt_len} + {args.gen_len} greedy tokens, "
        f"{args.rounds} rounds, {args.busy} busy neighbour(s){' pinned' if args.pin else ''}, "
        f"niceness {os.nice(0)}, {os.cpu_count()} cores; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after\n"
    )
    # ratios against tokenmill's one thread on the busy machine: above 1 is better
    # (tok/s over tok/s; the first token's one-thread time over this engine's)
    head = (
        "engine", "quiet tok/s", "busy tok/s", "busy / quiet", "busy / 1 thread",
        "quiet first token ms", "busy first token ms", "busy 1 thread / this",
    )  # fmt: skip
    rows = [
        (
            n,
            f"{m['quiet']:.1f}",
            f"{m['busy']:.1f}",
            f"{m['busy'] / m['quiet']:.2f}x",
            f"{m['busy'] / own_one:.2f}x",
            f"{ttft[n]['quiet']:.0f}",
            f"{ttft[n]['busy']:.0f}",
            f"{own_one_ttft / ttft[n]['busy']:.2f}x",
        )  # fmt: skip
        for n, m in med.items()
    ]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\nevery run, tok/s; first token ms:")
    for n, r in runs.items():
        t = ttfts[n]
        print(
            f"  {n}: quiet {[round(v, 1) for v in r['quiet']]}, busy {[round(v, 1) for v in r['busy']]}"
            f"; quiet {[round(v) for v in t['quiet']]}, busy {[round(v) for v in t['busy']]}"
        )
    if args.json:
        out = {
            "model": str(path),
            "threads": threads,
            "args": vars(args),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "runs": runs,
            "medians": med,
            "first_token_ms": ttfts,
            "first_token_medians_ms": ttft,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
