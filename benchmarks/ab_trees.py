"""Two (or more) tokenmill source trees side by side on one GGUF: is a change slower?

    git worktree add /tmp/before REV --detach
    python benchmarks/ab_trees.py MODEL.gguf /tmp/before . [--rounds 5] [--quick]
    python benchmarks/ab_trees.py MODEL.gguf .@TOKENMILL_ADAPTIVE_THREADS=0 .

Each TREE (optionally TREE@NAME=VALUE, an environment variable for that tree's process
only) runs in its own process with PYTHONPATH=TREE, so each compiles and loads its own
kernels, on 2 threads with prefix caching off. Rounds are interleaved, the order
alternating, so that a burst of load from elsewhere hits every tree alike; round 0 warms
up. Per round: TTFT of a 128-token prompt and the decode speed of the 64 greedy tokens
after it, then (without --quick) the TTFT of a 512-token prompt. Prints medians.
--gap S waits S seconds before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], enable_prefix_caching=False, threads=2, kv_cache_memory="1024tok")
ids = [(i * 7919) % 20000 + 100 for i in range(512)]  # any ids of the vocabulary
print("ready", flush=True)
for line in sys.stdin:
    out = {}
    for p, gen in ((128, 65), (512, 1))[: 1 if sys.argv[2] == "quick" else 2]:
        sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
        t = llm.generate([ids[:p]], sp)[0].outputs[0].timings
        out[f"prefill{p}"] = p / t.time_to_first_token
        if gen > 1:
            out["decode"] = t.decode_tokens_per_s
    print(json.dumps(out), flush=True)
"""


def start(tree: str, model: str, quick: bool) -> subprocess.Popen:
    path, _, setting = tree.partition("@")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    if setting:
        name, _, value = setting.partition("=")
        env[name] = value
    args = [sys.executable, "-c", WORKER, model, "quick" if quick else "full"]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit(f"{tree}: the worker did not start")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("trees", nargs="+", help="TREE or TREE@NAME=VALUE")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="no 512-token prompt")
    ap.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="seconds of quiet before each run (the previous tree's threads spin on after "
        "its run, and tokenmill's adaptive threads see them)",
    )
    args = ap.parse_args()
    procs = {t: start(t, args.model, args.quick) for t in args.trees}
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds + 1):
        for t in args.trees if r % 2 == 0 else args.trees[::-1]:
            time.sleep(args.gap)
            procs[t].stdin.write("run\n")
            procs[t].stdin.flush()
            out = json.loads(procs[t].stdout.readline())
            print(f"round {r} {t}: {out}", flush=True)
            if r:
                runs[t].append(out)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait(timeout=60)
    for t, rs in runs.items():
        medians = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        print(f"{t}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in medians.items()))


if __name__ == "__main__":
    main()
