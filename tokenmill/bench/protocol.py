"""The bench's wire: the workload every engine runs, the reply line, the peak-RSS probe.

Torch-free on purpose: the llama.cpp worker imports this without loading torch (its
peak RSS is its own).
"""

from __future__ import annotations

import json
import random
import resource
from dataclasses import dataclass
from pathlib import Path

# Peer name -> (module to import, pip packages that provide it).
PEERS: dict[str, tuple[str, list[str]]] = {
    "transformers": ("transformers", ["transformers", "accelerate"]),
    "llamacpp": ("llama_cpp", ["llama-cpp-python"]),
}
# Native code, minus ggml's AMX kernels: they segfault in ggml_backend_amx_mul_mat on
# Sapphire Rapids VMs (llama.cpp issue 20824). The -mno-amx flags are no-ops elsewhere.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_CMAKE_ARGS = f"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{_NO_AMX}' -DCMAKE_CXX_FLAGS='{_NO_AMX}'"
WARMUP_REQUESTS, WARMUP_TOKENS = 8, 8  # throughput warm-up: a few short requests
# The calibration the time estimate comes from (estimate.py): this many requests at once,
# each the first CALIBRATION_PROMPT_TOKENS ids of the first latency prompt, each
# generating CALIBRATION_TOKENS tokens.
CALIBRATION_REQUESTS, CALIBRATION_PROMPT_TOKENS, CALIBRATION_TOKENS = 8, 16, 8
REPLY = "@@bench "  # a worker's reply line starts with this
PHASES = ("latency", "throughput")

# The workload's sizes: option -> (full run, --quick). --quick took 1.7-5 minutes on a
# busy 2-core machine with transformers beside tokenmill; the full run, tens of minutes.
PRESETS: dict[str, tuple] = {
    "runs": (5, 2),
    "prompt_len": ([128, 512], [128]),
    "gen_len": (128, 32),
    "num_requests": (64, 8),
    "request_prompt_len": ((32, 512), (32, 128)),
    "request_gen_len": ((32, 256), (16, 32)),
    "bandwidth_mib": (2048, 512),
    "gemm_size": (4096, 2048),
}

# The latency prompt: this text, tokenized and repeated to exactly P tokens.
PROMPT_TEXT = (
    "The mill stood where the river bent twice before the town. Every morning the miller "
    "opened the sluice, the wheel took the water, and the stones began to turn. Farmers "
    "came with carts of wheat and rye, waited their turn by the wall, and talked about the "
    "weather, the price of salt and the new bridge that the council had promised for years. "
    "The miller weighed each sack, wrote the weight in a ledger with a blunt pencil, and "
    "kept one part in twenty as his fee. In dry summers the river ran low and the wheel "
    "turned slowly, so he ground at night when the pond behind the weir had filled again. "
)


# ---------------------------------------------------------------------- the workload


@dataclass
class Workload:
    """What every engine runs: the model, the settings and the exact token ids."""

    model: str  # a .gguf file or a checkpoint folder
    dtype: str
    threads: int
    runs: int
    gen_len: int
    latency_prompts: dict[str, list[int]]  # str(P) -> exactly P token ids
    requests: list[tuple[list[int], int]]  # (prompt token ids, output tokens)
    skip: list[str]
    kv_cache_memory: str | None
    peer_batch_size: int
    activation_bits: int = 16  # tokenmill only: its kernels' activation precision
    tensor_parallel_size: int = 1  # tokenmill only: its ranks (peers run on one process)
    pipeline_parallel_size: int = 1


def calibration_requests(latency_prompts: dict[str, list[int]]) -> list[tuple[list[int], int]]:
    """The calibration's requests: short prompts cut from the first latency prompt."""
    prompt = next(iter(latency_prompts.values()))[:CALIBRATION_PROMPT_TOKENS]
    return [(prompt, CALIBRATION_TOKENS)] * CALIBRATION_REQUESTS


def calibration_reply(requests: list[tuple[list[int], int]], wall_s: float) -> dict:
    """What a worker answers to `calibrate`: the wall time and the requests' sizes."""
    return {
        "wall_s": wall_s,
        "requests": len(requests),
        "prompt_tokens": len(requests[0][0]),
        "output_tokens": requests[0][1],
    }


def latency_prompt(tokenizer, length: int) -> list[int]:
    """Exactly `length` ids: the tokenizer's BOS (when it adds one), then PROMPT_TEXT repeated."""
    ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=True)
    body = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    while len(ids) < length:
        ids += body
    return ids[:length]


def random_requests(
    n: int, prompt_range: tuple[int, int], gen_range: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: lengths uniform in the ranges, ids uniform."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append((prompt, rng.randint(*gen_range)))
    return requests


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's getrusage maxrss would carry the parent's
    RSS at fork over into a child; VmHWM belongs to the program the child exec'd."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reply(message: dict) -> None:
    print(REPLY + json.dumps(message), flush=True)
