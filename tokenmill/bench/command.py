"""`tokenmill bench`: its arguments and the whole run."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench import estimate, shapes
from tokenmill.bench.engines import Engines, installed_peers, log, resolve_peers
from tokenmill.bench.machine import gguf_decode_bytes, measure_machine
from tokenmill.bench.progress import RunProgress
from tokenmill.bench.protocol import (
    PEERS,
    PHASES,
    PRESETS,
    Workload,
    latency_prompt,
    random_requests,
)
from tokenmill.bench.report import (
    build_report,
    render,
    require_matplotlib,
    table_width,
    write_plot,
)
from tokenmill.checks import int_at_least
from tokenmill.cli.common import add_precision_args, speculative_method


def build_workload(args: argparse.Namespace, path: Path, threads: int) -> Workload:
    from tokenmill.engine.llm_engine import load_tokenizer
    from tokenmill.loader import open_checkpoint

    config = open_checkpoint(path).config
    longest = max(
        max(args.prompt_len) + args.gen_len, args.request_prompt_len[1] + args.request_gen_len[1]
    )
    if longest > config.max_position:
        raise ValueError(
            f"the longest sequence ({longest} tokens) exceeds the model's context of {config.max_position}"
        )
    tokenizer = load_tokenizer(path)
    return Workload(
        model=str(path),
        dtype=args.dtype,
        threads=threads,
        runs=args.runs,
        gen_len=args.gen_len,
        latency_prompts={str(p): latency_prompt(tokenizer, p) for p in args.prompt_len},
        requests=random_requests(
            args.num_requests,
            args.request_prompt_len,
            args.request_gen_len,
            config.vocab_size,
            args.seed,
        ),
        skip=args.skip,
        kv_cache_memory=args.kv_cache_memory,
        peer_batch_size=args.peer_batch_size,
        activation_bits=getattr(args, "activation_bits", 16),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
    )


# ---------------------------------------------------------------------- the command


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _int_range(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}")
    return values[0], values[1]


def _peer_list(text: str) -> list[str]:
    if text == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer {unknown[0]!r} (known: {', '.join(PEERS)}, or none)"
        )
    return names


def _add_preset_option(
    p: argparse.ArgumentParser, flag: str, kind: Callable[[str], object], text: str
) -> None:
    """A size whose default comes from PRESETS (the full run's or --quick's): None here,
    filled in by apply_preset; its help shows both defaults."""
    full, quick = PRESETS[flag.removeprefix("--").replace("-", "_")]
    shown = [
        ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v) for v in (full, quick)
    ]
    described = f"{text} (default {shown[0]}; with --quick {shown[1]})"
    p.add_argument(flag, type=kind, default=None, help=described)


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure latency and throughput next to transformers, llama.cpp and the machine's limits",
        description="Measure tokenmill next to its peers and the machine's limits. The full "
        "run takes tens of minutes on a small machine; the time it will take is printed "
        "after each engine's first runs. --quick takes a few minutes.",
    )
    add_model_args(p)
    add_precision_args(p)
    p.add_argument(
        "--shape",
        default=None,
        metavar="NAME[:TYPE]",
        help="instead of --model: random weights of a real model's shape "
        f"({', '.join(shapes.names())}) in a llama.cpp file type ({', '.join(shapes.FILE_TYPES)}; "
        f"default {shapes.DEFAULT_FILE_TYPE}), written once into the cache (bench/shapes.py)",
    )
    p.add_argument(
        "--types",
        default=None,
        metavar="LIST",
        help="one row per GGUF file type (e.g. q4_k_m,q5_k_m,q6_k,q8_0,q3_k_m,q2_k,iq4_xs,iq3_s): "
        "--shape's Q8_0 file (or --model's GGUF) re-quantized to each by llama.cpp's quantizer "
        "(cached), each benched beside the peers, then one table (bench/types.py)",
    )
    p.add_argument(
        "--shape-layers",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="with --shape: this many of the model's layers (default: all of a dense "
        "model's, 4 of a mixture of experts')",
    )
    p.add_argument(
        "--context",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="measure prefill and decode tok/s after each context length instead "
        "(e.g. 512,2048,8192), beside llama.cpp with flash attention at the nearest KV "
        "type (q8_0 for --kv-cache-dtype q8_0), and each engine's KV bytes per token "
        "(bench/context.py); uses --runs, --gen-len, --threads",
    )
    p.add_argument(
        "--speculative",
        nargs="?",
        const="ngram",
        default=None,
        type=speculative_method,
        metavar="ngram|draft:PATH",
        help="measure speculative decoding instead: decode tok/s on input-grounded tasks "
        "and on free text, plain and speculating (ngram when no value is given), beside "
        "llama.cpp with and without prompt lookup, the acceptance, whether the outputs "
        "equal plain's, and a verification step's cost against a plain step "
        "(bench/speculative.py); uses --runs, --gen-len, --threads",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int_at_least(1),
        default=4,
        metavar="K",
        help="with --speculative: most guesses per step (default: 4)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="with --context: also each engine's peak memory beyond its weights and KV "
        "cache at each context length, each engine in a process of its own",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes: fewer and shorter runs, one prompt length, 8 throughput "
        "requests, smaller machine tests, and only the peers already installed",
    )
    _add_preset_option(
        p, "--runs", int_at_least(1), "timed latency runs per prompt length (median)"
    )
    _add_preset_option(p, "--prompt-len", _int_list, "latency prompt lengths, e.g. 128,512")
    _add_preset_option(p, "--gen-len", int_at_least(2), "tokens generated per latency run")
    _add_preset_option(
        p, "--num-requests", int_at_least(1), "throughput requests, all submitted at once"
    )
    _add_preset_option(p, "--request-prompt-len", _int_range, "throughput prompt lengths MIN,MAX")
    _add_preset_option(p, "--request-gen-len", _int_range, "throughput output lengths MIN,MAX")
    p.add_argument("--seed", type=int, default=0, help="seed of the throughput requests")
    p.add_argument(
        "--peers",
        type=_peer_list,
        default=None,
        help="transformers,llamacpp (default; with --quick those installed) or none",
    )
    p.add_argument("--install-peers", action="store_true", help="pip install missing peers first")
    p.add_argument(
        "--peer-batch-size",
        type=int_at_least(1),
        default=64,
        help="transformers: requests per generate() batch",
    )
    p.add_argument(
        "--skip", action="append", choices=PHASES, default=[], help="skip a phase (repeatable)"
    )
    _add_preset_option(p, "--bandwidth-mib", int_at_least(1), "buffer size of the bandwidth test")
    _add_preset_option(p, "--gemm-size", int_at_least(1), "N of the N x N x N GEMM test")
    p.add_argument(
        "--embeddings",
        action="store_true",
        help="measure embedding throughput instead (inputs/s at 32 and 512 tokens, beside "
        "llama.cpp's embedding mode on the same GGUF; bench/embeddings.py)",
    )
    p.add_argument(
        "--rerank",
        action="store_true",
        help="measure reranking instead (documents/s and the scores' agreement, beside "
        "llama.cpp's reranking mode on the same reranker GGUF: --model's, or a random "
        "Qwen3-Reranker-0.6B shape; bench/rerank.py)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG bar chart (needs matplotlib)"
    )
    p.set_defaults(func=cmd_bench)


def apply_preset(args: argparse.Namespace) -> dict[str, dict]:
    """Fill each size the command line left out from the full run's or --quick's preset,
    and --peers: every peer, or with --quick (and no --install-peers) those installed.
    Returns {peer: skipped entry} for the peers --quick leaves out."""
    args.quick = quick = getattr(args, "quick", False)
    for option, (full, fast) in PRESETS.items():
        if getattr(args, option, None) is None:
            setattr(args, option, fast if quick else full)
    left_out = {}
    if getattr(args, "peers", None) is None:
        args.peers = list(PEERS)
        if quick and not args.install_peers:
            args.peers = installed_peers()
            for name in PEERS:
                if name not in args.peers:
                    reason = "not installed (--quick runs the installed peers only; add "
                    reason += f"--install-peers to install {PEERS[name][1][0]})"
                    left_out[name] = {"status": "skipped", "reason": reason}
    return left_out


def use_shape(args: argparse.Namespace) -> None:
    """--shape: the cached random-weight file of that shape becomes the model."""
    spec = getattr(args, "shape", None)
    if spec is None:
        if getattr(args, "shape_layers", None) is not None:
            raise ValueError("--shape-layers applies to --shape; add --shape NAME[:TYPE]")
        return
    if args.model is not None:
        raise ValueError("--shape and --model each name the model; choose one")
    args.model = str(shapes.cached(spec, args.shape_layers, log=log))


def cmd_bench(args: argparse.Namespace) -> None:
    from tokenmill.engine.llm_engine import resolve_model

    # (before any shape file is built or re-quantized: those take minutes)
    if getattr(args, "memory", False) and not getattr(args, "context", None):
        raise ValueError("--memory measures with --context; add --context N,N,...")
    if getattr(args, "types", None):
        from tokenmill.bench.types import cmd_types

        return cmd_types(args, cmd_bench)
    if getattr(args, "rerank", False):
        from tokenmill.bench.rerank import cmd_rerank

        return cmd_rerank(args)
    left_out = apply_preset(args)
    use_shape(args)
    if args.device != "cpu":
        raise ValueError("tokenmill bench measures CPU inference; --device must be cpu")
    if min(args.runs, args.num_requests, args.peer_batch_size) < 1 or args.gen_len < 2:
        raise ValueError(
            "--runs, --num-requests and --peer-batch-size must be >= 1, --gen-len >= 2"
        )
    modes = [f for f, on in (("--context", args.context), ("--embeddings", args.embeddings),
             ("--speculative", getattr(args, "speculative", None))) if on]  # fmt: skip
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} are separate measurements; choose one")
    if getattr(args, "speculative", None):
        return _cmd_speculative(args)
    if args.embeddings:
        from tokenmill.bench.embeddings import cmd_embeddings

        return cmd_embeddings(args)
    if args.context:
        return _cmd_context(args)
    if args.plot:
        require_matplotlib()
    path = resolve_model(args.model)
    threads = args.threads or os.cpu_count() or 1
    work = build_workload(args, path, threads)
    gguf_bytes = gguf_decode_bytes(path) if path.suffix == ".gguf" else None
    if not args.quick:
        log(
            "the full run takes tens of minutes on a small machine (and compiling llama.cpp "
            "for --install-peers about 15 more); how long is printed after each engine's "
            "first runs (--quick takes a few minutes)"
        )
    peers, skipped = resolve_peers(args.peers, args.install_peers, path)
    skipped.update(left_out)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        spec = Path(tmp) / "workload.json"
        spec.write_text(json.dumps(asdict(work)))
        with Engines(["tokenmill", *peers], spec) as engines:
            for result in engines.raw.values():
                if result["status"] == "ok":  # no bytes reported: the GGUF tensors as stored
                    result["decode_bytes_per_token"] = (
                        result["decode_bytes_per_token"] or gguf_bytes
                    )
            log("measuring memory bandwidth and GEMM throughput")
            working_sets = {
                n: r["decode_bytes_per_token"]
                for n, r in engines.raw.items()
                if r["status"] == "ok"
            }
            machine = measure_machine(threads, args.bandwidth_mib, args.gemm_size, working_sets)
            plan = measure_the_rest(engines, work, args, machine)
            log(plan.announcement())
            with RunProgress(plan.remaining_s, plan.price) as progress:
                if "latency" not in work.skip:
                    engines.latency(
                        list(work.latency_prompts), work.runs, progress, {plan.first: 2}
                    )
                if "throughput" not in work.skip:
                    engines.throughput(progress)
            elapsed = time.perf_counter() - plan.started
            raw = {**engines.finish(), **skipped}
    machine["load_average_before"], machine["load_average_after"] = load_before, os.getloadavg()
    report = build_report(work, args, machine, raw, gguf_bytes)
    report["estimate"] = {**plan.summary(), "took_s": elapsed}
    log(f"the timed runs took {elapsed / 60:.1f} minutes (estimated {plan.remaining_s / 60:.1f})")
    from rich.console import Console

    Console(width=max(Console().width, 160, table_width(report))).print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"report written to {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        log(f"chart written to {args.plot}")


def _cmd_context(args: argparse.Namespace) -> None:
    """--context: bench/context.py's rows and table, and --json's report of them."""
    from tokenmill.bench.context import cmd_context
    from tokenmill.engine.llm_engine import resolve_model

    if args.plot:  # before the run, not after it
        require_matplotlib()
    path = resolve_model(args.model)
    report = cmd_context(args, path, args.threads or os.cpu_count() or 1, log)
    if args.plot:
        from tokenmill.bench.report import write_context_plot

        write_context_plot(
            report["context"], args.plot, f"{path.name}, {report['settings']['threads']} threads"
        )
        log(f"chart written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"report written to {args.json}")


def _cmd_speculative(args: argparse.Namespace) -> None:
    """--speculative: bench/speculative.py's rows, table and cost curve, and --json's
    report of them."""
    from tokenmill.bench.speculative import cmd_speculative
    from tokenmill.engine.llm_engine import resolve_model

    if args.plot:
        raise ValueError("--plot draws the latency and --context charts; --speculative has none")
    path = resolve_model(args.model)
    report = cmd_speculative(args, path, args.threads or os.cpu_count() or 1, log)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"report written to {args.json}")


# ---------------------------------------------------------------------- the time estimate


class Plan:
    """What the rest of the run costs, engine by engine, from their first runs."""

    def __init__(self, speeds: dict[str, estimate.Speed], work: Workload, quick_s: float | None):
        self.speeds, self.work, self.quick_s = speeds, work, quick_s
        self.first = next(iter(work.latency_prompts))  # its warm-up and first round ran
        lengths = [(len(p), n) for p, n in work.requests]
        self.per_engine = estimate.phases_s(
            speeds,
            [int(p) for p in work.latency_prompts],
            work.runs,
            work.gen_len,
            lengths,
            work.skip,
            done={int(self.first): 2},
        )
        self.remaining_s = sum(self.per_engine.values())
        self.started = time.perf_counter()

    def price(self, engine: str, phase: str, prompt_len: str | None) -> float:
        s = self.speeds.get(engine)
        if s is None:  # an engine that failed before its first runs
            return 0.0
        if phase == "latency":
            return estimate.latency_run_s(s, int(prompt_len), self.work.gen_len)
        return estimate.throughput_s(s, [(len(p), n) for p, n in self.work.requests])

    def announcement(self) -> str:
        line = f"this will take {estimate.minutes(self.remaining_s)} more"
        if self.quick_s is not None:
            line += f"; --quick takes {estimate.minutes(self.quick_s)} in all"
        return line + " (estimated from each engine's first runs)"

    def summary(self) -> dict:
        return {
            "remaining_s": self.remaining_s,
            "per_engine_s": self.per_engine,
            "quick_total_s": self.quick_s,
        }


def measure_the_rest(
    engines: Engines, work: Workload, args: argparse.Namespace, machine: dict
) -> Plan:
    """Each engine's first runs (the first prompt length's warm-up round and first timed
    round, then a calibration batch), and from them the Plan of the rest; with the full
    run, also what --quick would take from the start. The warm-up is no measure: an
    engine's first run took 10-20 times a warm one on a busy 2-core machine. With
    --skip latency these runs are made for the estimate alone and left out of the report."""
    first = next(iter(work.latency_prompts))
    log("first runs of each engine, for the time estimate")
    start = time.perf_counter()
    engines.latency([first], work.runs, rounds=1)  # the warm-up round
    cold_s = time.perf_counter() - start
    engines.latency([first], work.runs, done={first: 1}, rounds=1)
    start = time.perf_counter()
    engines.calibrate()
    calibration_s = time.perf_counter() - start
    speeds = {
        name: estimate.speed(r["latency"][first][0], r["calibration"], int(first), r["batching"])
        for name, r in engines.raw.items()
        if r["status"] == "ok" and "calibration" in r and first in r.get("latency", {})
    }
    if "latency" in work.skip:  # the first runs were for the estimate only
        for r in engines.raw.values():
            r.pop("latency", None)
    quick_s = None
    if not args.quick:
        measured_s = cold_s + calibration_s
        quick_s = _quick_total_s(engines, work, speeds, machine, measured_s, args.seed)
    return Plan(speeds, work, quick_s)


def _quick_total_s(
    engines: Engines,
    work: Workload,
    speeds: dict[str, estimate.Speed],
    machine: dict,
    measured_s: float,
    seed: int,
) -> float:
    """What `tokenmill bench --quick` takes from start to end with these engines: their
    loads, the cold warm-up round and the calibration as measured (`measured_s`), the
    rest priced at --quick's sizes."""
    from tokenmill.loader import open_checkpoint

    quick = {option: fast for option, (_, fast) in PRESETS.items()}
    vocab = open_checkpoint(Path(work.model)).config.vocab_size  # the draws depend on it
    requests = random_requests(
        quick["num_requests"], quick["request_prompt_len"], quick["request_gen_len"], vocab, seed
    )
    lengths = [(len(p), n) for p, n in requests]
    loads = sum(r.get("load_s", 0.0) for r in engines.raw.values())
    phases = estimate.phases_s(
        speeds,
        quick["prompt_len"],
        quick["runs"],
        quick["gen_len"],
        lengths,
        work.skip,
        done={quick["prompt_len"][0]: 1},  # its warm-up: measured here at this run's sizes
    )
    machine_s = estimate.machine_s(machine, quick["bandwidth_mib"], quick["gemm_size"])
    return loads + machine_s + measured_s + sum(phases.values())
