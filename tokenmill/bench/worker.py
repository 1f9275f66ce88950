"""The tokenmill worker: `python -m tokenmill.bench SPEC` (see the package docstring)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from tokenmill.bench.machine import torch_decode_bytes, weight_bytes_by_dtype
from tokenmill.bench.protocol import (
    WARMUP_REQUESTS,
    WARMUP_TOKENS,
    Workload,
    calibration_reply,
    calibration_requests,
    peak_rss_bytes,
    reply,
)

# ---------------------------------------------------------------------- the tokenmill worker


class TokenmillRunner:
    """tokenmill in a bench worker. Prefix caching is off: every run computes its prompt."""

    def __init__(self, work: Workload):
        from tokenmill import kernels
        from tokenmill.llm import LLM

        start = time.perf_counter()
        # the workload's engine settings are LLM arguments of the same names
        settings = ("dtype", "threads", "kv_cache_memory", "activation_bits")
        parallel = ("tensor_parallel_size", "pipeline_parallel_size")
        engine = {name: getattr(work, name) for name in (*settings, *parallel)}
        self.llm = LLM(work.model, enable_prefix_caching=False, **engine)
        self._ids = itertools.count()
        engine = self.llm.engine
        tied = engine.model.embed if engine.model.lm_head is None else None
        self.info = {
            "load_s": time.perf_counter() - start,
            "decode_bytes_per_token": torch_decode_bytes(engine.model, tied),
            "weight_bytes_by_dtype": weight_bytes_by_dtype(engine.model),
            "kv_pool_bytes": engine.cache.nbytes,
            "batching": {"mode": "continuous", "max_seqs": engine.scheduler.max_num_seqs},
            "kernels": kernels.isa(),
            # models/paths.py: "stack" (the fused native decode stack) or why not
            "decode_path": engine.model.decode_path().name,
            "notes": [
                "prefix caching off",
                f"prefill of packed weights: {engine.info()['prefill']}",
                f"{engine.activation_bits}-bit activations",
                f"GEMV prefetch {kernels.prefetch_bytes()} bytes ahead",
            ],
        }
        if engine.parallel is not None:  # what each rank holds, and (per run) collectives
            self.info["parallel"] = {
                "world_size": engine.parallel.world,
                "ranks": engine.parallel_plan,
            }
            self.info["notes"].append(
                f"{engine.parallel.world} ranks: " + "; ".join(engine.parallel_plan)
            )

    def latency(self, prompt: list[int], gen_len: int) -> dict:
        from tokenmill.sampling import SamplingParams

        params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
        group = getattr(self.llm.engine.runner, "group", None)
        spent = group.collective_s if group is not None else 0.0
        t = self.llm.generate([prompt], params)[0].timings
        if t.prefill_tokens != len(prompt):
            raise RuntimeError(f"computed {t.prefill_tokens} of {len(prompt)} prompt tokens")
        out = {
            "ttft_s": t.time_to_first_token,
            "decode_s": t.total - t.time_to_first_token,
            "output_tokens": t.output_tokens,
        }
        if group is not None:  # rank 0's seconds inside collectives, per generated token
            out["collective_s_per_token"] = (group.collective_s - spent) / t.output_tokens
        return out

    def throughput(self, requests: list[tuple[list[int], int]]) -> dict:
        """A short warm-up, then every request added at once and the engine stepped until
        all finish."""
        engine = self.llm.engine
        self._run_all([(p, min(n, WARMUP_TOKENS)) for p, n in requests[:WARMUP_REQUESTS]])
        tokens, preemptions = engine.stats["generation_tokens"], engine.kv_stats()["preemptions"]
        start = time.perf_counter()
        self._run_all(requests)
        return {
            "wall_s": time.perf_counter() - start,
            "computed_output_tokens": engine.stats["generation_tokens"] - tokens,
            "mode": f"continuous batching (max_num_seqs {engine.scheduler.max_num_seqs})",
            "preemptions": engine.kv_stats()["preemptions"] - preemptions,
        }

    def calibrate(self, requests: list[tuple[list[int], int]]) -> dict:
        """The requests run together once, timed (for the time estimate)."""
        start = time.perf_counter()
        self._run_all(requests)
        return calibration_reply(requests, time.perf_counter() - start)

    def _run_all(self, requests: list[tuple[list[int], int]]) -> None:
        from tokenmill.sampling import SamplingParams

        engine = self.llm.engine
        for prompt, n in requests:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            engine.add_request(f"bench-{next(self._ids)}", prompt, params)
        while engine.has_unfinished():
            engine.step()


def serve(spec_path: str) -> None:
    """The tokenmill worker: load, reply with the facts, then answer commands until `exit`."""
    work = Workload(**json.loads(Path(spec_path).read_text()))
    runner = TokenmillRunner(work)
    reply(runner.info)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "latency":
            reply(runner.latency(work.latency_prompts[arg], work.gen_len))
        elif command == "calibrate":
            reply(runner.calibrate(calibration_requests(work.latency_prompts)))
        elif command == "throughput":
            reply(runner.throughput(work.requests))
        elif command == "exit":
            reply({"peak_rss_bytes": peak_rss_bytes()})
            return
