"""The figures derived from the workers' raw times, the table, the notes and the plot."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

from tokenmill.bench.protocol import Workload

# ---------------------------------------------------------------------- figures


# Runs of one figure further apart than this are not noise: something else had the CPUs.
DISAGREE_RATIO = 2.0


def summarize_runs(values: list[float]) -> dict:
    """One figure over several runs: the median, and the lowest and highest run. The median
    alone hides runs that disagree (with 2 runs it is their mean: 16.5 and 125.7 give 71.1)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def runs_disagree(runs: dict) -> bool:
    """Whether the highest run of a summarize_runs figure is over DISAGREE_RATIO x the lowest."""
    return runs["max"] > DISAGREE_RATIO * runs["min"]


def format_runs(runs: dict, digits: int = 1) -> str:
    """The median, then the lowest-highest run when they differ: `71.1 (16.5-125.7)`."""
    median = _fmt(runs["median"], digits)
    if runs["min"] == runs["max"]:
        return median
    return f"{median} ({_fmt(runs['min'], digits)}-{_fmt(runs['max'], digits)})"


def summarize_latency(samples: list[dict], prompt_len: int) -> dict:
    """Medians of the raw runs (TTFT in ms, prefill and decode tokens/s), each figure's
    spread over the runs (summarize_runs), and the best run of each, which a busy machine
    disturbs least."""
    ttft = [s["ttft_s"] * 1e3 for s in samples]
    prefill = [prompt_len / s["ttft_s"] for s in samples]
    decode = [(s["output_tokens"] - 1) / s["decode_s"] for s in samples]
    spread = {
        "ttft_ms": summarize_runs(ttft),
        "prefill_tok_s": summarize_runs(prefill),
        "decode_tok_s": summarize_runs(decode),
    }
    out = {
        **{figure: runs["median"] for figure, runs in spread.items()},
        "spread": spread,
        "best": {"ttft_ms": min(ttft), "prefill_tok_s": max(prefill), "decode_tok_s": max(decode)},
        "runs": samples,
    }
    if all("collective_s_per_token" in s for s in samples):  # a parallel tokenmill run
        out["collective_ms_per_token"] = statistics.median(
            s["collective_s_per_token"] * 1e3 for s in samples
        )
    return out


def summarize_throughput(raw: dict, requests: list[tuple[list[int], int]]) -> dict:
    """Requested output tokens/s and prompt + output tokens/s over the wall time."""
    prompt = sum(len(p) for p, _ in requests)
    output = sum(n for _, n in requests)
    return {
        **raw,
        "requests": len(requests),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tok_s": output / raw["wall_s"],
        "total_tok_s": (prompt + output) / raw["wall_s"],
    }


def summarize_engine(name: str, raw: dict, work: Workload, machine: dict) -> dict:
    """An engine's figures from its raw times (decode_bytes_per_token already filled in)."""
    entry = {k: v for k, v in raw.items() if k not in ("latency", "throughput")}
    per_token = raw["decode_bytes_per_token"]
    entry["decode_ceiling_tok_s"] = machine["read_gb_s"] * 1e9 / per_token
    entry["working_set_ceiling_tok_s"] = machine["working_set_read_gb_s"][name] * 1e9 / per_token
    if "latency" in raw:
        entry["latency"] = {p: summarize_latency(s, int(p)) for p, s in raw["latency"].items()}
        first = min(entry["latency"], key=int)  # the headline decode figure: shortest prompt
        entry["decode_tok_s"] = entry["latency"][first]["decode_tok_s"]
        entry["ratio_to_ceiling"] = entry["decode_tok_s"] / entry["decode_ceiling_tok_s"]
    if "throughput" in raw:
        entry["throughput"] = summarize_throughput(raw["throughput"], work.requests)
    return entry


def build_report(
    work: Workload,
    args: argparse.Namespace,
    machine: dict,
    raw: dict[str, dict],
    gguf_bytes: int | None,
) -> dict:
    """The whole report (what --json writes): machine, model, settings, engines."""
    import tokenmill

    engines = {
        name: summarize_engine(name, r, work, machine) if r["status"] == "ok" else r
        for name, r in raw.items()
    }
    base = engines.get("tokenmill", {}).get("decode_tok_s")
    for entry in engines.values():
        if "decode_tok_s" in entry:
            entry["ratio_to_tokenmill"] = entry["decode_tok_s"] / base if base else None
    path = Path(work.model)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return {
        "tokenmill_version": tokenmill.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "model": {
            "path": str(path),
            "file_bytes": sum(f.stat().st_size for f in files),
            "gguf_decode_bytes_per_token": gguf_bytes,
            "gguf_decode_ceiling_tok_s": machine["read_gb_s"] * 1e9 / gguf_bytes
            if gguf_bytes
            else None,
        },
        "settings": {
            "quick": getattr(args, "quick", False),
            "dtype": work.dtype,
            "threads": work.threads,
            "runs": work.runs,
            "prompt_lens": args.prompt_len,
            "gen_len": work.gen_len,
            "num_requests": len(work.requests),
            "request_prompt_len": list(args.request_prompt_len),
            "request_gen_len": list(args.request_gen_len),
            "seed": args.seed,
            "kv_cache_memory": work.kv_cache_memory,
            "peer_batch_size": work.peer_batch_size,
            "activation_bits": work.activation_bits,
            "skip": work.skip,
        },
        "engines": engines,
    }


# ---------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def render(report: dict):
    """The report as rich renderables: the table, then the machine, the model and the notes."""
    from rich.console import Group
    from rich.text import Text

    lines = _disagreement_lines(report)
    lines += [_machine_line(report["machine"]), _model_line(report["model"])]
    for name, e in report["engines"].items():
        lines.append(
            _engine_note(name, e)
            if e["status"] == "ok"
            else f"{name}: {e['status']}: {e['reason']}"
        )
    return Group(_results_table(report), *(Text(line) for line in lines))


def _results_table(report: dict):
    from rich.table import Table

    lens = [str(p) for p in report["settings"]["prompt_lens"]]
    n = report["settings"]["num_requests"]
    title = f"tokenmill bench: {Path(report['model']['path']).name}, {report['settings']['dtype']}"
    if report["settings"].get("quick"):
        title += " (--quick: few, short runs)"
    table = Table(title=title)
    columns = ["engine", "kernels"]
    columns += [*(f"TTFT ms @{p}" for p in lens), *(f"prefill tok/s @{p}" for p in lens)]
    columns += ["decode tok/s", "ceiling tok/s", "vs ceiling"]
    columns += ["vs tokenmill", f"throughput tok/s ({n} req)", "peak RSS MiB"]
    table.add_column(columns[0], no_wrap=True)
    for column in columns[1:]:
        table.add_column(column, justify="right")
    for name, e in report["engines"].items():
        if e["status"] != "ok":
            continue
        lat = e.get("latency", {})
        first = min(lat, key=int, default=None)  # the decode column's prompt length
        table.add_row(
            name,
            e.get("kernels", "-"),
            *(format_runs(lat[p]["spread"]["ttft_ms"], 0) if p in lat else "-" for p in lens),
            *(format_runs(lat[p]["spread"]["prefill_tok_s"]) if p in lat else "-" for p in lens),
            format_runs(lat[first]["spread"]["decode_tok_s"]) if first is not None else "-",
            _fmt(e["decode_ceiling_tok_s"]),
            _fmt(e.get("ratio_to_ceiling"), 2, "x"),
            _fmt(e.get("ratio_to_tokenmill"), 2, "x"),
            _fmt(e["throughput"]["output_tok_s"]) if "throughput" in e else "-",
            _fmt(e["peak_rss_bytes"] / 2**20, 0),
        )
    return table


def table_width(report: dict) -> int:
    """The console columns the results table takes with each row on one line. A narrower
    console makes rich cut cells short with an ellipsis, and a median's range is the widest
    text in its cell."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)
    return Measurement.get(console, console.options, _results_table(report)).maximum


FIGURE_NAMES = {
    "ttft_ms": "TTFT ms",
    "prefill_tok_s": "prefill tok/s",
    "decode_tok_s": "decode tok/s",
}


def _disagreement_lines(report: dict) -> list[str]:
    """A warning per engine whose runs of a figure disagree (runs_disagree): its median in
    the table is then no measure of the engine."""
    lines = []
    for name, e in report["engines"].items():
        figures = [
            f"{FIGURE_NAMES[figure]} @{p}"
            for p, lat in e.get("latency", {}).items()
            for figure, runs in lat["spread"].items()
            if runs_disagree(runs)
        ]
        if figures:
            lines.append(
                f"warning: {name}: runs disagree by more than {DISAGREE_RATIO:g}x "
                f"({', '.join(figures)}): the machine is busy"
            )
    return lines


def _machine_line(m: dict) -> str:
    bf = m["gemm_gflop_s"]["bfloat16"]
    bf16 = "bf16 not measured (no native bf16)" if bf is None else f"bf16 {bf:.0f} GFLOP/s"
    working_sets = ", ".join(f"{n} {v:.1f}" for n, v in m["working_set_read_gb_s"].items())
    return (
        f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; memory read "
        f"{m['read_gb_s']:.1f} GB/s ({m['bandwidth_buffer_mib']} MiB buffer), copy "
        f"{m['copy_gb_s']:.1f} GB/s, read at each engine's working set: {working_sets} GB/s; "
        f"GEMM {m['gemm_size']}^3 fp32 {m['gemm_gflop_s']['float32']:.0f} GFLOP/s, "
        f"{bf16}; load average "
        f"{m['load_average_before'][0]:.1f} before, {m['load_average_after'][0]:.1f} after"
    )


def _model_line(model: dict) -> str:
    line = f"model file {model['file_bytes'] / 2**20:.1f} MiB"
    if model["gguf_decode_bytes_per_token"]:
        line += (
            f"; a decode step reads {model['gguf_decode_bytes_per_token'] / 2**20:.1f} MiB of "
            f"its tensors as stored (DRAM ceiling {model['gguf_decode_ceiling_tok_s']:.0f} tok/s)"
        )
    return line


def _engine_note(name: str, e: dict) -> str:
    parts = [
        f"load {e['load_s']:.1f} s",
        f"reads {e['decode_bytes_per_token'] / 2**20:.1f} MiB/token",
        f"working-set ceiling {e['working_set_ceiling_tok_s']:.1f} tok/s",
    ]
    coll = [
        f"@{p} {lat['collective_ms_per_token']:.2f} ms"
        for p, lat in e.get("latency", {}).items()
        if "collective_ms_per_token" in lat
    ]
    if coll:  # a parallel run: rank 0's time inside collectives per generated token
        parts.append("collectives per token " + ", ".join(coll))
    if "weight_bytes_by_dtype" in e:
        stored = ", ".join(
            f"{d} {b / 2**20:.1f} MiB" for d, b in e["weight_bytes_by_dtype"].items()
        )
        parts.append(f"weights {stored}")
    if e.get("kv_pool_bytes") is not None:
        parts.append(f"KV pool {e['kv_pool_bytes'] / 2**20:.0f} MiB")
    if "throughput" in e:
        t = e["throughput"]
        parts.append(
            f"throughput: {t['mode']}, {t['wall_s']:.1f} s, {t['total_tok_s']:.1f} prompt+output tok/s"
        )
    return f"{name}: " + "; ".join(parts + e.get("notes", []))


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')"
        )


def write_plot(report: dict, path: str) -> None:
    """A PNG with three bar charts: decode (with each engine's ceiling), prefill, throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = {n: e for n, e in report["engines"].items() if e["status"] == "ok"}
    names = list(engines)
    x = range(len(names))
    fig, (dec, pre, thr) = plt.subplots(1, 3, figsize=(15, 4.5))
    decode = [e.get("decode_tok_s") or 0 for e in engines.values()]
    ceilings = [e["decode_ceiling_tok_s"] for e in engines.values()]
    dec.bar_label(dec.bar(x, decode, label="measured"), fmt="%.1f", label_type="center")
    dec.scatter(x, ceilings, marker="_", s=800, color="red", label="ceiling")
    dec.set_ylim(0, 1.3 * max(decode + ceilings))
    dec.set_title("batch-1 decode tok/s")
    dec.legend(loc="upper center", ncols=2)
    lens = [str(p) for p in report["settings"]["prompt_lens"]]
    width = 0.8 / len(lens)
    for i, p in enumerate(lens):
        values = [e.get("latency", {}).get(p, {}).get("prefill_tok_s", 0) for e in engines.values()]
        bars = pre.bar([j + i * width for j in x], values, width, label=f"P={p}")
        pre.bar_label(bars, fmt="%.0f")
    pre.set_title("batch-1 prefill tok/s")
    pre.legend()
    bars = thr.bar(x, [e.get("throughput", {}).get("output_tok_s", 0) for e in engines.values()])
    thr.bar_label(bars, fmt="%.1f")
    thr.set_title(f"output tok/s, {report['settings']['num_requests']} requests")
    for ax in (dec, pre, thr):
        ax.set_xticks([j + (0.4 - width / 2 if ax is pre else 0) for j in x], names)
    fig.suptitle(
        f"{Path(report['model']['path']).name}, {report['settings']['dtype']}, {report['machine']['cpu']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_context_plot(
    rows: list[dict], path: str, title: str
) -> dict[str, list[tuple[int, float]]]:
    """A PNG of `bench --context`'s rows: prefill and decode tok/s (log scale) against the
    prompt's tokens, one line per engine and KV type. Returns the plotted series,
    "{engine} {kv} {prefill|decode}" -> [(prompt tokens, tok/s)], in context order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for r in sorted(rows, key=lambda r: r["prompt_tokens"]):
        for phase in ("prefill", "decode"):
            key = f"{r['engine']} {r['kv']} {phase}"
            series.setdefault(key, []).append((r["prompt_tokens"], r[f"{phase}_tok_s"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        for key, points in series.items():
            if key.endswith(phase):
                ax.plot(*zip(*points, strict=True), marker="o", label=key.removesuffix(f" {phase}"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{phase} tok/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return series
