"""Peer engines for `tokenmill bench`: Hugging Face transformers and llama.cpp.

    python -m tokenmill.bench.peers ENGINE SPEC      ENGINE: transformers or llamacpp

`tokenmill bench` starts this once per peer, as that peer's own process (so its peak RSS
is its own), and drives it like its tokenmill worker (see the package docstring):

    SPEC      the workload as JSON: model, dtype, threads, gen_len, latency_prompts
              {P: token ids}, requests [[token ids, output tokens], ...], peer_batch_size
    reply     after loading: {load_s, decode_bytes_per_token (null: the GGUF tensors as
              stored), kv_pool_bytes (null: none preallocated), batching (how its
              throughput run batches: estimate.py), notes}
    commands  one per stdin line, each answered by one stdout line `@@bench <json>`:
              latency P   -> {ttft_s, decode_s, output_tokens}
              calibrate   -> {wall_s, requests, prompt_tokens, output_tokens}
              throughput  -> {wall_s, computed_output_tokens, mode}
              exit        -> {peak_rss_bytes}

The llama.cpp runner imports only the bench's wire (protocol.py), which loads no torch:
its process's RSS stays llama.cpp's own.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tokenmill.bench.context import llama_kv_bytes_per_token
from tokenmill.bench.protocol import (
    WARMUP_REQUESTS,
    WARMUP_TOKENS,
    calibration_reply,
    calibration_requests,
    peak_rss_bytes,
    reply,
)

Requests = list[tuple[list[int], int]]


# ---------------------------------------------------------------------- transformers


class _TokenClock:
    """A generate() streamer that records when each new token arrives (its first put() is
    the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class TransformersRunner:
    """AutoModelForCausalLM in `dtype` (a GGUF file is dequantized by transformers at load)."""

    def __init__(self, spec: dict):
        import torch
        from transformers import AutoModelForCausalLM

        from tokenmill.bench.machine import torch_decode_bytes, weight_bytes_by_dtype

        torch.set_num_threads(spec["threads"])
        path, dtype = Path(spec["model"]), getattr(torch, spec["dtype"])
        start = time.perf_counter()
        if path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=dtype
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model = model.eval()
        embed = model.get_input_embeddings()
        tied = embed if model.get_output_embeddings().weight is embed.weight else None
        self.batch_size = spec["peer_batch_size"]
        self.info = {
            "load_s": time.perf_counter() - start,
            "decode_bytes_per_token": torch_decode_bytes(model, tied),
            "weight_bytes_by_dtype": weight_bytes_by_dtype(model),
            "kv_pool_bytes": None,
            "batching": {"mode": "static", "size": self.batch_size},
            "notes": [
                "TTFT from one forward over the prompt",
                "KV cache grows per batch",
            ],
        }

    def latency(self, prompt: list[int], gen_len: int) -> dict:
        """TTFT: one forward over the prompt and the argmax of its last row. Decode: the time
        between the first and the last token of generate(min_new_tokens=max_new_tokens=G)."""
        import torch

        ids = torch.tensor([prompt])
        with torch.inference_mode():
            start = time.perf_counter()
            self.model(ids, use_cache=True).logits[:, -1].argmax(-1)
            ttft = time.perf_counter() - start
            clock = _TokenClock()
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=gen_len,
                min_new_tokens=gen_len,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
        return {
            "ttft_s": ttft,
            "decode_s": clock.times[-1] - clock.times[0],
            "output_tokens": len(clock.times),
        }

    def throughput(self, requests: Requests) -> dict:
        """Static batches of `peer_batch_size` requests, left-padded, each generating to its
        longest requested output."""
        self._generate(requests[:WARMUP_REQUESTS], cap=WARMUP_TOKENS)
        computed = 0
        start = time.perf_counter()
        for i in range(0, len(requests), self.batch_size):
            computed += self._generate(requests[i : i + self.batch_size])
        return {
            "wall_s": time.perf_counter() - start,
            "computed_output_tokens": computed,
            "mode": f"static batches of up to {self.batch_size}, left-padded, each to its longest output",
        }

    def calibrate(self, requests: Requests) -> dict:
        """The requests as one batch, timed (for the time estimate)."""
        start = time.perf_counter()
        self._generate(requests)
        return calibration_reply(requests, time.perf_counter() - start)

    def _generate(self, batch: Requests, cap: int | None = None) -> int:
        """One left-padded batched generate to the batch's longest output (at most `cap`);
        the tokens it computed."""
        import torch

        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = min(max(n for _, n in batch), cap or sys.maxsize)
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return new * len(batch)


# ---------------------------------------------------------------------- llama.cpp


class LlamaCppRunner:
    """llama-cpp-python on the GGUF file as stored, n_batch 512, n_ctx fitting the longest
    sequence of the workload."""

    def __init__(self, spec: dict):
        from llama_cpp import Llama

        longest = max(
            [len(p) + spec["gen_len"] for p in spec["latency_prompts"].values()]
            + [len(p) + n for p, n in spec["requests"]]
        )
        start = time.perf_counter()
        self.llm = Llama(
            model_path=spec["model"],
            n_ctx=longest,
            n_batch=512,
            n_threads=spec["threads"],
            n_threads_batch=spec["threads"],
            verbose=False,
        )
        self.info = {
            "load_s": time.perf_counter() - start,
            "decode_bytes_per_token": None,
            "kv_pool_bytes": self._kv_bytes(),
            "kernels": self._kernels(),
            "batching": {"mode": "sequential"},
            "notes": ["GGUF weights as stored (--dtype does not apply), f16 KV cache, n_batch 512"],
        }

    @staticmethod
    def _kernels() -> str:
        """The SIMD features ggml was built with, from llama_print_system_info()
        ("... AVX2 = 1 | F16C = 1 | ..."), e.g. "AVX2 FMA F16C"."""
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        wanted = ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8", "AVX_VNNI", "AVX2")
        wanted += ("FMA", "F16C", "NEON", "ARM_FMA", "DOTPROD", "SVE")
        on = {
            k.strip() for k, _, v in (p.partition("=") for p in info.split("|")) if v.strip() == "1"
        }
        return " ".join(f for f in wanted if f in on) or "-"

    def _kv_bytes(self) -> int:
        """The KV cache llama.cpp allocated: n_ctx tokens of f16 K and V in every layer
        (64 bytes per 32 values)."""
        return self.llm.n_ctx() * llama_kv_bytes_per_token(self.llm.metadata, 64)

    def latency(self, prompt: list[int], gen_len: int) -> dict:
        """Greedy tokens after the whole prompt, on a reset context (no KV reuse)."""
        self.llm.reset()
        times = []
        start = time.perf_counter()
        # generate() edits the list it is given, hence the copy.
        for _ in self.llm.generate(list(prompt), temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == gen_len:
                break
        return {
            "ttft_s": times[0] - start,
            "decode_s": times[-1] - times[0],
            "output_tokens": len(times),
        }

    def calibrate(self, requests: Requests) -> dict:
        """The requests one after another, timed (for the time estimate)."""
        start = time.perf_counter()
        for prompt, n in requests:
            self.latency(prompt, n)
        return calibration_reply(requests, time.perf_counter() - start)

    def throughput(self, requests: Requests) -> dict:
        """One request after another: llama-cpp-python has no continuous batching."""
        for prompt, n in requests[:WARMUP_REQUESTS]:
            self.latency(prompt, min(n, WARMUP_TOKENS))
        start = time.perf_counter()
        for prompt, n in requests:
            self.latency(prompt, n)
        return {
            "wall_s": time.perf_counter() - start,
            "computed_output_tokens": sum(n for _, n in requests),
            "mode": "sequential: llama-cpp-python has no continuous batching",
        }


# ---------------------------------------------------------------------- the worker loop

RUNNERS = {"transformers": TransformersRunner, "llamacpp": LlamaCppRunner}


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in RUNNERS:
        sys.exit(f"usage: peers.py {{{','.join(RUNNERS)}}} SPEC")
    spec = json.loads(Path(argv[1]).read_text())
    runner = RUNNERS[argv[0]](spec)
    reply(runner.info)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "latency":
            reply(runner.latency(spec["latency_prompts"][arg], spec["gen_len"]))
        elif command == "calibrate":
            reply(runner.calibrate(calibration_requests(spec["latency_prompts"])))
        elif command == "throughput":
            reply(runner.throughput(spec["requests"]))
        elif command == "exit":
            reply({"peak_rss_bytes": peak_rss_bytes()})
            return


if __name__ == "__main__":
    main(sys.argv[1:])
