"""`tokenmill bench --types q4_k_m,q5_k_m,...`: one row per GGUF file type of one model.

Each type is the same model re-quantized by llama.cpp's own quantizer (llama-cpp-python's
`llama_model_quantize`) from one source file: a `--shape`'s Q8_0 file (random weights of a
real shape) or the `--model` GGUF given. The files are cached beside the source (the
cache folder's shapes/ for a shape). Each runs the ordinary latency bench (cmd_bench:
tokenmill and the peers on the same file, side by side), then one table gathers the rows:

    type | file MiB | bits per weight: file / tokenmill | decode tok/s and share of the
    DRAM ceiling, per engine | prefill tok/s | peak RSS MiB

Bits per weight are of what one decode step reads (bench/machine.py gguf_decode_bytes:
the un-embedding whole, the embedding one row), over the same weights' count.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

from tokenmill.bench import shapes
from tokenmill.bench.engines import log

# llama.cpp's file types by the names its `llama-quantize` takes (lower case here, as
# --shape's types), each its LLAMA_FTYPE_MOSTLY_* constant in llama-cpp-python
TYPES = (
    "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q4_0", "q4_1", "q5_0", "q5_1",
    "q3_k_l", "q3_k_m", "q3_k_s", "q2_k", "iq4_xs", "iq4_nl", "iq3_m", "iq3_s", "iq3_xxs",
    "tq1_0", "tq2_0",
)  # fmt: skip
# Types whose quantizer asks for an importance matrix (IQ1_*, IQ2_*): llama.cpp refuses them
# without one, which this bench does not build
NEEDS_IMATRIX = ("iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")


def parse_types(text: str) -> list[str]:
    """'q4_k_m,IQ4_XS' -> ['q4_k_m', 'iq4_xs']; ValueError naming an unknown one."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    for name in names:
        if name in NEEDS_IMATRIX:
            raise ValueError(
                f"--types: {name} needs an importance matrix for llama.cpp's quantizer, "
                "which this bench does not build"
            )
        if name not in TYPES:
            raise ValueError(f"--types: unknown type {name!r}; choose from {', '.join(TYPES)}")
    if not names:
        raise ValueError("--types: name at least one type, e.g. q4_k_m,q5_k_m")
    return names


def requantized(source: Path, ftype: str) -> Path:
    """`source` re-quantized to `ftype` by llama.cpp's quantizer, cached beside it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError("--types needs llama-cpp-python (llama.cpp's quantizer)") from e
    path = source.with_name(f"{source.stem}-as-{ftype}.gguf")
    if path.exists():
        return path
    log(f"writing {path.name}: {source.name} re-quantized by llama.cpp to {ftype} (once)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize, params.nthread = True, os.cpu_count() or 1
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with _quiet_stderr():  # llama.cpp logs every tensor it converts
            status = llama_cpp.llama_model_quantize(
                str(source).encode(), str(tmp).encode(), ctypes.byref(params)
            )
        if status != 0:
            raise ValueError(f"llama.cpp's quantizer failed on {source.name} -> {ftype}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a while: what C code (llama.cpp) writes there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def decode_weights(path: Path) -> int:
    """How many weights one decode step reads, as gguf_decode_bytes counts its bytes."""
    from gguf import GGUFReader

    from tokenmill.bench.machine import _gguf_experts

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    experts, used = _gguf_experts(reader)
    total = 0
    for t in tensors.values():
        n = int(t.n_elements)
        if "_exps." in t.name and 0 < used < experts:
            n = n * used // experts
        lookup = t.name == "position_embd.weight" or (
            t.name == "token_embd.weight" and "output.weight" in tensors
        )
        total += n // int(t.shape[-1]) if lookup else n
    return total


def cmd_types(args: argparse.Namespace, run_one) -> None:
    """Re-quantize, bench each file with run_one(args) (cmd_bench), then the table."""
    names = parse_types(args.types)
    if getattr(args, "shape", None):
        shape, _ = shapes.parse_spec(args.shape)
        source = shapes.cached(f"{shape}:q8_0", args.shape_layers, log=log)
    elif args.model and str(args.model).endswith(".gguf"):
        source = Path(args.model)
    else:
        raise ValueError("--types re-quantizes a GGUF: add --shape NAME or --model FILE.gguf")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-types-") as tmp:
        for name in names:
            path = requantized(source, name)
            one = copy.copy(args)
            one.model, one.shape, one.shape_layers, one.types = str(path), None, None, None
            one.json = str(Path(tmp) / f"{name}.json")
            log(f"--types: {name} ({path.name})")
            run_one(one)
            rows.append((name, path, json.loads(Path(one.json).read_text())))
    table = types_table(rows)
    from rich.console import Console

    Console(width=max(Console().width, 160)).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([r for _, _, r in rows], indent=2) + "\n")
        log(f"reports written to {args.json}")


def types_table(rows: list[tuple[str, Path, dict]]):
    """The rich table of cmd_types' rows: (type, file, its bench report)."""
    from rich.table import Table

    from tokenmill.bench.machine import gguf_decode_bytes

    engines = [e for e in rows[0][2]["engines"] if "decode_tok_s" in rows[0][2]["engines"][e]]
    table = Table(title=f"tokenmill bench --types: {rows[0][2]['machine'].get('cpu', '')}")
    table.add_column("type")
    table.add_column("file MiB", justify="right")
    table.add_column("bits/weight: file / tokenmill", justify="right")
    for e in engines:
        table.add_column(f"{e} decode tok/s (of ceiling)", justify="right")
    table.add_column("prefill tok/s: " + " / ".join(engines), justify="right")
    table.add_column("peak RSS MiB: " + " / ".join(engines), justify="right")
    for name, path, report in rows:
        weights = decode_weights(path)
        eng = report["engines"]
        mine = eng.get("tokenmill", {}).get("decode_bytes_per_token")
        bits = f"{8 * gguf_decode_bytes(path) / weights:.2f} / " + (
            f"{8 * mine / weights:.2f}" if mine else "-"
        )
        cells = [name, f"{report['model']['file_bytes'] / 2**20:,.0f}", bits]
        for e in engines:
            r = eng.get(e, {})
            cells.append(
                f"{r['decode_tok_s']:.1f} ({r['ratio_to_ceiling']:.0%})"
                if "decode_tok_s" in r
                else "-"
            )

        def latency(r: dict, key: str) -> str:
            lat = r.get("latency") or {}
            return f"{lat[max(lat, key=int)][key]:.0f}" if lat else "-"

        cells.append(" / ".join(latency(eng.get(e, {}), "prefill_tok_s") for e in engines))
        cells.append(
            " / ".join(
                f"{eng[e]['peak_rss_bytes'] / 2**20:,.0f}"
                if eng.get(e, {}).get("peak_rss_bytes")
                else "-"
                for e in engines
            )
        )
        table.add_row(*cells)
    return table
