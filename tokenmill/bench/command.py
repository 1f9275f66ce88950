"""`tokenmill bench`: its arguments and the whole run."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench.engines import Engines, log, resolve_peers
from tokenmill.bench.machine import gguf_decode_bytes, measure_machine
from tokenmill.bench.protocol import PEERS, PHASES, Workload, latency_prompt, random_requests
from tokenmill.bench.report import build_report, render, require_matplotlib, write_plot


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


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure latency and throughput next to transformers, llama.cpp and the machine's limits",
    )
    add_model_args(p)
    p.add_argument(
        "--runs", type=int, default=5, help="timed latency runs per prompt length (median)"
    )
    p.add_argument(
        "--prompt-len",
        type=_int_list,
        default=[128, 512],
        help="latency prompt lengths, e.g. 128,512",
    )
    p.add_argument("--gen-len", type=int, default=128, help="tokens generated per latency run")
    p.add_argument(
        "--num-requests", type=int, default=64, help="throughput requests, all submitted at once"
    )
    p.add_argument(
        "--request-prompt-len",
        type=_int_range,
        default=(32, 512),
        help="throughput prompt lengths MIN,MAX",
    )
    p.add_argument(
        "--request-gen-len",
        type=_int_range,
        default=(32, 256),
        help="throughput output lengths MIN,MAX",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the throughput requests")
    p.add_argument(
        "--peers",
        type=_peer_list,
        default=list(PEERS),
        help="transformers,llamacpp (default) or none",
    )
    p.add_argument("--install-peers", action="store_true", help="pip install missing peers first")
    p.add_argument(
        "--peer-batch-size",
        type=int,
        default=64,
        help="transformers: requests per generate() batch",
    )
    p.add_argument(
        "--skip", action="append", choices=PHASES, default=[], help="skip a phase (repeatable)"
    )
    p.add_argument(
        "--bandwidth-mib", type=int, default=2048, help="buffer size of the bandwidth test"
    )
    p.add_argument("--gemm-size", type=int, default=4096, help="N of the N x N x N GEMM test")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG bar chart (needs matplotlib)"
    )
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> None:
    from rich.console import Console

    from tokenmill.engine.llm_engine import resolve_model

    if args.device != "cpu":
        raise ValueError("tokenmill bench measures CPU inference; --device must be cpu")
    if min(args.runs, args.num_requests, args.peer_batch_size) < 1 or args.gen_len < 2:
        raise ValueError(
            "--runs, --num-requests and --peer-batch-size must be >= 1, --gen-len >= 2"
        )
    if args.plot:
        require_matplotlib()
    path = resolve_model(args.model)
    threads = args.threads or os.cpu_count() or 1
    work = build_workload(args, path, threads)
    gguf_bytes = gguf_decode_bytes(path) if path.suffix == ".gguf" else None
    peers, skipped = resolve_peers(args.peers, args.install_peers, path)
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
            if "latency" not in work.skip:
                engines.latency(list(work.latency_prompts), work.runs)
            if "throughput" not in work.skip:
                engines.throughput()
            raw = {**engines.finish(), **skipped}
    machine["load_average_before"], machine["load_average_after"] = load_before, os.getloadavg()
    report = build_report(work, args, machine, raw, gguf_bytes)
    Console(width=max(Console().width, 160)).print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"report written to {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        log(f"chart written to {args.plot}")
