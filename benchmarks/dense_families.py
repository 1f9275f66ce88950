"""Decode speed per weight byte of each dense family against the Llama path's.

    python benchmarks/dense_families.py --ftype q4_0 --runs 3

Issue 24's target for the newer dense families: each decodes "at the same speed per weight
byte as the Llama path", through the same fused stack. For each family this writes the
same Llama-3.2-1B layer shape in that family's layout (`random_gguf.py --family`: Phi-3's
fused projections, Gemma 2's sandwich norms and soft-caps, OLMo 2's post-norms and
whole-projection Q/K norms, SmolLM3's NoPE layers, Granite's multipliers), runs
`tokenmill bench --peers llamacpp --skip throughput` on it, and prints one row per family:
tokenmill's and llama.cpp's decode tok/s, the bytes a decode step reads, tokenmill's
read rate in GB/s, and that rate against the Llama layout's. The Llama layout runs first
and again last, so drift in the machine's speed over the run shows as the gap between its
two rows; the ratio is against their mean.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from random_gguf import FAMILIES, FILE_TYPES, write  # noqa: E402


def bench(path: Path, out: Path, runs: int, gen: int) -> dict:
    """`tokenmill bench` of one file (batch-1 latency only, beside llama.cpp), its JSON."""
    cmd = ["tokenmill", "bench", "--model", str(path), "--peers", "llamacpp"]
    cmd += ["--skip", "throughput", "--runs", str(runs), "--prompt-len", "128"]
    cmd += ["--gen-len", str(gen), "--json", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def row(family: str, report: dict) -> dict:
    tm = report["engines"]["tokenmill"]
    peer = report["engines"].get("llamacpp", {})
    per_token = tm["decode_bytes_per_token"]
    return {
        "family": family,
        "tokenmill_tok_s": tm["decode_tok_s"],
        "llamacpp_tok_s": peer.get("decode_tok_s"),
        "bytes_per_token": per_token,
        "gb_s": tm["decode_tok_s"] * per_token / 1e9,
        "path": tm.get("decode_path"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--ftype", choices=FILE_TYPES, default="q4_0")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--dir", type=Path, default=Path("/tmp/tokenmill-families"))
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in (*FAMILIES, "llama"):  # the Llama layout first and last
        path = args.dir / f"{args.shape}-{args.ftype}-{family}.gguf"
        if not path.exists():
            write(args.shape, args.ftype, path, family=family)
        report = bench(path, args.dir / f"{path.stem}-{len(rows)}.json", args.runs, args.gen_len)
        rows.append(row(family, report))
    base = (rows[0]["gb_s"] + rows[-1]["gb_s"]) / 2
    print(f"\n{args.shape} layer shape, {args.ftype}, decode after a 128-token prompt")
    print("| layout | decode tok/s: tokenmill / llama.cpp | MiB read per token | "
          "tokenmill GB/s | per byte vs Llama |")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in rows:
        peer = f"{r['llamacpp_tok_s']:.1f}" if r["llamacpp_tok_s"] else "-"
        print(
            f"| {r['family']} | {r['tokenmill_tok_s']:.1f} / {peer} | "
            f"{r['bytes_per_token'] / 2**20:.0f} | {r['gb_s']:.2f} | {r['gb_s'] / base:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
