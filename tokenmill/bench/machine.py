"""The machine's limits, measured in the same run: memory bandwidth (over a buffer far
larger than the last-level cache, and over each engine's working set), copy bandwidth,
GEMM throughput; and the bytes one decode step reads, per engine."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------- the machine


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of fn() over `repeats` calls, after one untimed call. The best run,
    as STREAM reports: other processes can only slow a run down, never speed it up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def read_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """GB/s of a read-only sum over an `nbytes` float32 buffer: its sum of squares,
    torch.dot of the buffer with itself (BLAS streams it faster than torch.sum does)."""
    import torch

    buf = torch.ones(max(1, nbytes // 4))
    return buf.nbytes / _best_time(lambda: torch.dot(buf, buf), repeats) / 1e9


def copy_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """GB/s of copying `nbytes` into another buffer, read and write bytes counted."""
    import torch

    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_time(lambda: dst.copy_(src), repeats) / 1e9


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16, AMX, Arm BF16). Without
    it torch emulates a bf16 GEMM, minutes for 4096^3 and meaningless as a limit."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = {f for line in text.splitlines() if line.startswith(("flags", "Features"))
             for f in line.split(":", 1)[1].split()}  # fmt: skip
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def gemm_gflops(size: int, dtype, repeats: int = 3) -> float:
    """GFLOP/s of a size x size x size matrix product in `dtype`."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_time(lambda: a @ b, repeats) / 1e9


def measure_machine(
    threads: int, buffer_mib: int, gemm_size: int, working_sets: dict[str, int]
) -> dict[str, Any]:
    """Memory bandwidth (GB/s) and GEMM throughput (GFLOP/s) with `threads` torch threads.
    working_sets: {engine: bytes a decode step reads}, read bandwidth measured at that size.
    "seconds": how long the bandwidth and the GEMM parts took (the time estimate scales
    them to other sizes)."""
    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    read = read_bandwidth(buffer_mib * 2**20)
    copy = copy_bandwidth(buffer_mib * 2**20 // 2)
    bandwidth_s = time.perf_counter() - start
    working = {n: read_bandwidth(b) for n, b in working_sets.items()}
    start = time.perf_counter()
    gemm = {
        "float32": gemm_gflops(gemm_size, torch.float32),
        "bfloat16": gemm_gflops(gemm_size, torch.bfloat16) if has_native_bf16() else None,
    }
    gemm_s = time.perf_counter() - start
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "read_gb_s": read,
        "copy_gb_s": copy,
        "working_set_read_gb_s": working,
        "gemm_gflop_s": gemm,
        "bandwidth_buffer_mib": buffer_mib,
        "gemm_size": gemm_size,
        "seconds": {"bandwidth": bandwidth_s, "gemm": gemm_s},
    }


# ---------------------------------------------------------------------- bytes per decode step


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors that one decode step reads: all of them, except that a
    lookup table (token or position embedding) gives one row, unless the token embedding is
    also the (tied) un-embedding, which reads it whole; and that of a Mixture of Experts'
    3-D expert tensors (blk.N.ffn_*_exps) one token reads the k experts its router picks
    of the E: the active parameters, which set a MoE model's decode ceiling."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    experts, used = _gguf_experts(reader)
    if 0 < used < experts:
        for t in tensors.values():
            if "_exps." in t.name:
                total -= int(t.n_bytes) - int(t.n_bytes) * used // experts
    lookups = ["position_embd.weight"]
    if "output.weight" in tensors:
        lookups.append("token_embd.weight")
    for name in lookups:
        if name in tensors:
            t = tensors[name]
            rows = int(t.shape[-1])  # GGUF lists dims fastest first: [d, rows]
            total -= int(t.n_bytes) - int(t.n_bytes) // rows
    return total


def _gguf_experts(reader) -> tuple[int, int]:
    """(expert_count, expert_used_count) from a GGUF's header; (0, 0) for a dense model."""
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else ""
    counts = [fields.get(f"{arch}.{key}") for key in ("expert_count", "expert_used_count")]
    if any(c is None for c in counts):
        return 0, 0
    return int(counts[0].contents()), int(counts[1].contents())


def _storages(model) -> list[tuple[str, int]]:
    """(dtype, bytes) of each distinct storage behind a torch model's state dict (tied
    weights share one)."""
    found = {}
    for tensor in model.state_dict().values():
        storage = tensor.untyped_storage()
        found[storage.data_ptr()] = (str(tensor.dtype).removeprefix("torch."), storage.nbytes())
    return list(found.values())


def torch_decode_bytes(model, tied_embedding=None) -> int:
    """Bytes of a torch model's weights that one decode step reads: every tensor of its state
    dict, tied ones once, except that an `nn.Embedding` (or the model's packed `embed`)
    gives one row, unless it is `tied_embedding`, the table the un-embedding reads whole,
    and that an MoE layer's token reads its top_k experts of the num_experts (as
    gguf_decode_bytes)."""
    import torch

    from tokenmill.layers.moe import MoE
    from tokenmill.layers.native_linear import NativeLinear

    total = sum(nbytes for _, nbytes in _storages(model))
    # a packed token embedding (NativeLinear: a GGUF's quantized token_embd) is looked up
    # one row per token too, as nn.Embedding is, unless it is also the un-embedding
    packed = getattr(model, "embed", None)
    packed = packed if isinstance(packed, NativeLinear) else None
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module is not tied_embedding:
            weight = module.weight
            total -= weight.untyped_storage().nbytes() - weight[0].nbytes
        elif module is packed and module is not tied_embedding:
            held = sum(nbytes for _, nbytes in _storages(module))
            total -= held - held // module.out_features
        elif isinstance(module, MoE) and module.top_k < module.num_experts:
            per_kind: dict[str, int] = {}  # as the file's 3-D tensors: one per weight kind
            for expert in module.experts:
                for name, t in expert.state_dict().items():
                    per_kind[name] = per_kind.get(name, 0) + t.nbytes
            read = sum(n * module.top_k // module.num_experts for n in per_kind.values())
            total -= sum(per_kind.values()) - read
    return total


def weight_bytes_by_dtype(model) -> dict[str, int]:
    """Bytes of a torch model's state dict per dtype: how it stores its weights (float32, or
    packed uint8 codes with float16 scales...)."""
    totals: dict[str, int] = {}
    for dtype, nbytes in _storages(model):
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals
