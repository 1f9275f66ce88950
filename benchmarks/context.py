"""How decode and prefill speed fall as the context grows, per KV cache dtype, beside llama.cpp.

    python benchmarks/context.py [--contexts 512,2048,8192] [--kv float32,q8_0] [--runs 3]
                                 [--threads 2] [--gen 64] [--model PATH.gguf] [--json out.json]

`tokenmill bench --context` for several KV cache dtypes in one run: the measuring is
tokenmill/bench/context.py's (its docstring says how), every engine of a context length
taking turns run by run, llama.cpp (llama-cpp-python, when installed) once per KV type it
maps the dtypes to (f16 for the float ones, q8_0 for q8_0), with flash attention on, on the
same GGUF file (default: the default model's, SmolLM2-135M-Instruct Q4_1).

Run it on a quiet machine, and say which CPU (`lscpu`) with its figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill import hub
from tokenmill.bench.context import context_rows, llama_cpp_installed, markdown_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--kv", default="float32,q8_0", help="tokenmill's KV cache dtypes")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = Path(args.model or hub.fetch("smollm2-135m-instruct", quiet=True))
    if not llama_cpp_installed():
        print("llama.cpp: not installed (pip install llama-cpp-python)", flush=True)
    rows = context_rows(
        path, [int(c) for c in args.contexts.split(",")], runs=args.runs, gen=args.gen,
        threads=args.threads, kv_dtypes=args.kv.split(","),
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    print()
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
