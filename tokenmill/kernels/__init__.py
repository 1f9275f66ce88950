"""Native CPU kernels (linear layers over packed weights, decode attention, the whole
decode step), called through ctypes.

The C sources here (linear.c, gemm.c, attention.c, stack.c over the per-instruction-set
layer simd.h) are compiled on first use by `build.py` for the host (or TOKENMILL_MARCH) and
cached; linear.c's header documents the packed weight format, tm.h which code each
instruction set runs. `isa()` names the one loaded. If the library cannot be built or
loaded (no compiler, a sandbox without exec permission on the cache folder...),
`library()` returns None after one line on stderr (what failed, the cost, what to do)
and callers take their pure-torch path instead: slower, never a crash. Set
TOKENMILL_KERNELS=0 to force that path, TOKENMILL_REQUIRE_NATIVE=1 to make a failure raise.

Threads: every call takes torch.get_num_threads() as the threads it may use; the C side
(team.c) gives each parallel region fewer while a thread it had to wait for (descheduled
beside a busy process) would hold up every barrier, and tries the whole team again after
a cool-down. `team_stats()` says what it did; TOKENMILL_ADAPTIVE_THREADS=0 (or
`adaptive_threads(False)`) keeps every region at the threads asked for.

Everything here works on raw pointers (`tensor.data_ptr()`), so callers must pass
contiguous CPU tensors of the documented dtypes and keep them alive during the call.
"""

from __future__ import annotations

import _ctypes
import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.kernels.build import (
    BuildError,
    compile_library,
    compiled_here,
    describe_failure,
    require_native,
)

__all__ = [
    "TmWeight",
    "library",
    "load",
    "isa",
    "group_blocks",
    "reads_kquant_scales",
    "prefetch_bytes",
    "pack_gguf",
    "linear",
    "gemm",
    "gemm_prefill",
    "gemm_min_rows",
    "LinearPath",
    "linear_path",
    "PREFILL_MIN_T",
    "dequant_lanes",
    "lanes_f32",
    "dequant_rows",
    "decode_rows",
    "decode_attention",
    "TmShape",
    "TmLayer",
    "TmStack",
    "TmRows",
    "decode_stack",
    "adaptive_threads",
    "team_stats",
]


ABI = 22  # tm_info() // 1000 of the sources this module binds
F16, BF16, F32 = 16, 17, 32  # tm_weight.bits of float weights (4 and 8: packed blocks)
SCALE_E8M0 = 2  # tm_weight.scale_f16 of MXFP4's exponent-byte scales (tm.h TM_SCALE_E8M0)
Q8_0 = 8  # tm_layer.kv_bits of a KV cache of q8_0 blocks (tokenmill/dtypes.py)
DEFAULT_GROUP_BLOCKS = 16  # the packing used when no library is loaded (any would do)
# The most rows of x the GEMV takes before float32 tiles beat it (float weights, and
# packed ones where the integer GEMM is no faster): GEMV_MAX_ROWS of linear.c, which
# decides (tm_linear_path); named here for tests and benchmarks, checked at load.
PREFILL_MIN_T = 80


VP, I32, FLT = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float  # void *, int32_t, float


def _of(ctype: Any, *names: str) -> list[tuple[str, Any]]:
    """Fields of one C type, in tm.h's order: `_of(VP, "a", "b")` is `void *a, *b;`."""
    return [(name, ctype) for name in names]


class TmWeight(ctypes.Structure):
    """Mirror of `tm_weight` in tm.h: pointers into a packed weight's tensors."""

    _fields_ = [
        *_of(VP, "codes", "scales", "mins"),
        *_of(I32, "bits", "scale_f16", "n", "k"),
        *_of(VP, "dsup", "msup"),
        ("next", VP),  # the next rows' TmWeight (a segmented layer), or None
        ("lut", VP),  # table-coded 4-bit weights: the 16 values + 128 codes index, or None
        ("scale_zero", I32),  # K-quant scale codes' zero (IQ4_XS: 32)
        ("sup_shift", I32),  # dsup's values: its float16s times 2^-sup_shift
    ]


class TmShape(ctypes.Structure):
    """Mirror of `tm_shape` in tm.h: the model's shapes, shared by every layer."""

    _fields_ = [
        *_of(I32, "n_layers", "d", "H", "Hkv", "hd", "f", "act"),
        *_of(FLT, "eps", "swiglu_limit", "swiglu_alpha"),
    ]


class TmLayer(ctypes.Structure):
    """Mirror of `tm_layer` in tm.h: one block as both native decode paths see it."""

    _fields_ = [
        *_of(VP, "qkv", "o", "up", "down"),
        *_of(VP, "qkv_bias", "o_bias", "up_bias", "down_bias"),
        *_of(VP, "attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"),
        *_of(VP, "rcos", "rsin", "k_cache", "v_cache"),
        *_of(I32, "rot_dim", "window", "act16", "qk_full"),
        *_of(FLT, "scale", "softcap", "residual_scale"),
        ("moe", VP),  # a TmMoe, or None
        ("sinks", VP),  # [H] float, or None
        ("kv_bits", I32),  # the cache's values: F32, F16, BF16 or Q8_0
    ]


class TmMoe(ctypes.Structure):
    """Mirror of `tm_moe` in tm.h: an MoE layer's router, experts and shared expert."""

    _fields_ = [
        *_of(I32, "E", "k", "fe", "fs", "softmax_first", "norm_topk"),
        *_of(VP, "router", "router_bias", "up", "down"),
        *_of(VP, "shared_up", "shared_down", "shared_gate"),
        *_of(VP, "up_bias", "down_bias"),  # [E] pointers each, or None
    ]


# tm_allreduce_fn: (float *buf, int32 n, void *ctx), called back from tm_decode_stack
ALLREDUCE_FN = ctypes.CFUNCTYPE(None, VP, I32, VP)


class TmStack(ctypes.Structure):
    """Mirror of `tm_stack` in tm.h: the shapes, every layer, the final norm, and the
    tensor-parallel all-reduce (NULL on one rank)."""

    _fields_ = [
        *_of(VP, "shape", "layers", "final_norm"),
        ("allreduce", ALLREDUCE_FN),
        ("allreduce_ctx", VP),
    ]


class TmRows(ctypes.Structure):
    """Mirror of `tm_rows` in tm.h: the decode rows of one step."""

    _fields_ = [*_of(VP, "positions", "new_slots", "slots", "ctx_lens"), *_of(I32, "Bd", "cmax")]


STRUCTS = (TmWeight, TmLayer, TmStack, TmShape, TmRows, TmMoe)  # tm_struct_size(i) checks each

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None  # why library() is None: what it printed (or would have)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the C signatures (ctypes would otherwise truncate pointers to int)."""
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.tm_info.restype = i32
    lib.tm_linear.argtypes = [vp, vp, i32, vp, vp, i32, i32]
    lib.tm_linear.restype = i32
    lib.tm_gemm.argtypes = [vp, vp, i32, vp, vp, i32, i32]
    lib.tm_gemm.restype = i32
    lib.tm_gemm_min_rows.restype = i32
    lib.gemm_min_rows = lib.tm_gemm_min_rows()  # a build constant
    lib.tm_linear_path.argtypes = [i32, i32, i32, ctypes.c_char_p, i32]
    lib.tm_linear_path.restype = i32
    lib.linear_paths = {}  # (packed, rows) -> LinearPath: asked per forward, so kept
    lib.tm_dequant_lanes.argtypes = [vp, i32, i32, vp, i32]
    lib.tm_dequant_lanes.restype = None
    lib.tm_lanes_f32.argtypes = [vp, i32, i32, vp, i32]
    lib.tm_lanes_f32.restype = None
    lib.tm_dequant_rows.argtypes = [vp, vp, i32, vp]
    lib.tm_dequant_rows.restype = i32
    lib.tm_pack_gguf.argtypes = [i32, vp, ctypes.c_int64, i32, i32, vp, vp, vp, vp, i32]
    lib.tm_pack_gguf.restype = i32
    lib.tm_decode_attention.argtypes = [vp, vp, vp, vp, vp, i32]
    lib.tm_decode_attention.restype = i32
    lib.tm_decode_stack.argtypes = [vp, vp, vp, i32]
    lib.tm_decode_stack.restype = i32
    lib.tm_group_blocks.restype = i32
    lib.tm_kquant_scales.restype = i32
    lib.tm_prefetch_bytes.restype = i32
    lib.tm_isa.restype = ctypes.c_char_p
    lib.tm_amx.restype = ctypes.c_char_p
    lib.tm_struct_size.argtypes = [i32]
    lib.tm_struct_size.restype = i32
    lib.tm_team_adapt.argtypes = [i32]
    lib.tm_team_adapt.restype = i32
    lib.tm_team_stats.argtypes = [vp]
    lib.tm_team_stats.restype = None
    i64 = ctypes.c_int64  # the team's clock (tests drive it with their own times)
    lib.tm_now.restype = i64
    lib.tm_team_at.argtypes = [i32, i32, i64]
    lib.tm_team_at.restype = i32
    lib.tm_team_note.argtypes = [i32, i64, i64, i64]
    lib.tm_team_note.restype = None
    if lib.tm_info() // 1000 != ABI:
        raise OSError(f"kernel library reports ABI {lib.tm_info() // 1000}, expected {ABI}")
    if [_ask_path(lib, F32, t)[0] for t in (PREFILL_MIN_T, PREFILL_MIN_T + 1)] != [0, 2]:
        raise OSError(
            f"the library's GEMV takes other row counts than PREFILL_MIN_T {PREFILL_MIN_T}"
        )
    for which, struct in enumerate(STRUCTS):
        if lib.tm_struct_size(which) != ctypes.sizeof(struct):
            raise OSError(f"{struct.__name__} is {ctypes.sizeof(struct)} bytes in Python, "
                          f"{lib.tm_struct_size(which)} in C")  # fmt: skip
    return lib


def _open(path: str | os.PathLike) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        return _bind(lib)
    except (AttributeError, OSError):
        # Unload it: dlopen finds an open library by its path name, so the rebuilt file
        # at this same path would otherwise come back as this one.
        if hasattr(_ctypes, "dlclose"):  # POSIX
            _ctypes.dlclose(lib._handle)
        raise


def load(arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """Compile (if needed) and load the library for a target, e.g. ("-march=x86-64-v3",);
    None: the default (native, or TOKENMILL_MARCH). A cached file that does not load or
    is not this library (truncated by a full disk or a killed copy, another program's
    file) is rebuilt once in its place. Raises BuildError or OSError."""
    path = compile_library(arch_flags)
    try:
        return _open(path)
    except (AttributeError, OSError) as e:  # AttributeError: a symbol it lacks (tm_info)
        if compiled_here(path):  # not damaged: a rebuild would fail the same way
            raise OSError(f"cannot load the kernels just compiled, {path}: {e}") from None
        damaged = f"{path} did not load ({e})"
    path = compile_library(arch_flags, rebuild=True)
    try:
        return _open(path)
    except (AttributeError, OSError) as e:
        raise OSError(f"cannot load the kernels: {path} did not load ({e}), also when "
                      f"rebuilt; before: {damaged}") from None  # fmt: skip


def library(quiet: bool = False) -> ctypes.CDLL | None:
    """The loaded kernel library, or None if it is unavailable, after one line on stderr
    (not with `quiet`: `tokenmill info` prints it itself). TOKENMILL_KERNELS=0: None, on
    purpose and silently. TOKENMILL_REQUIRE_NATIVE=1: a failure raises (BuildError or
    OSError) instead, at every call."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("TOKENMILL_KERNELS", "1") != "0":
                try:
                    _lib = load()
                    _lib.tm_team_adapt(int(_adaptive))
                except (BuildError, OSError) as e:
                    if require_native():
                        e.add_note("TOKENMILL_REQUIRE_NATIVE=1: no fallback to the torch path")
                        raise
                    _error = describe_failure(e)
                    if not quiet:
                        # One tokenmill line, not a warnings-module dump with a source line.
                        print(f"tokenmill: {_error}", file=sys.stderr)
            _tried = True
    return _lib


def unavailable() -> str | None:
    """Why the native library is not loaded, as library() reports it (first line: what
    failed, the cost, what to do; then compiler lines), or None when it is loaded or
    TOKENMILL_KERNELS=0 turned it off. Raises like library() under
    TOKENMILL_REQUIRE_NATIVE=1."""
    # _error alone could be stale: tests swap _lib in and out
    return None if library(quiet=True) is not None else _error


def isa() -> str:
    """The instruction set the kernels run: avx512+vnni, avx512, avx2+vnni (AVX-VNNI), avx2,
    neon+dotprod, neon, scalar (emulated builds add "(simde)" or "(emulated)"), or "none"
    (no library: the pure-torch path)."""
    lib = library()
    return "none" if lib is None else lib.tm_isa().decode()


def group_blocks() -> int:
    """Blocks per lane-order group of the packed codes the loaded library expects."""
    lib = library()
    return DEFAULT_GROUP_BLOCKS if lib is None else lib.tm_group_blocks()


def prefetch_bytes() -> int:
    """How far ahead (in code bytes) the GEMV prefetches packed weights: 8 KB
    (kernels/tm.h), or TOKENMILL_PREFETCH; 0 without a library."""
    lib = library()
    return 0 if lib is None else lib.tm_prefetch_bytes()


def reads_kquant_scales() -> bool:
    """Whether the loaded library reads GGUF K-quant scales as stored (a uint8 code per
    block times a float16 per 256 values): every build since ABI 9."""
    lib = library()
    return lib is not None and bool(lib.tm_kquant_scales())


TEAM_STATS = (
    "regions",  # parallel regions that ran on more than one thread
    "slow_windows",  # 10 ms spans of regions that waited at barriers more than they worked
    "probes",  # times the whole team was tried again after a cool-down
    "failed_probes",  # probes whose window was slow again (the cool-down doubles)
    "shrunk_regions",  # regions that ran with fewer threads than asked for
    "deficit",  # threads taken off each region now
    "cool_ns",  # the current cool-down
    "adaptive",  # 1: teams shrink after stalls; 0: every region gets the threads asked for
)


# What tm_team_adapt was last given; engine/free_cores.py follows it too (it is read
# every step, so it is kept here rather than asked of the library).
_adaptive = os.environ.get("TOKENMILL_ADAPTIVE_THREADS", "1") != "0"


def adaptive_threads(on: bool | None = None) -> bool:
    """Whether parallel regions shrink their team after a stalled thread (team.c) and
    engine steps run on the cores other processes leave free (engine/free_cores.py), and
    with `on`, set it (False: the fixed team, as before; the results are the same either
    way for the kernels; torch's own ops, whose thread count a shrunk team lowers too, may
    differ in the last bits). Returns the setting in force before the call; False without
    the library."""
    global _adaptive
    lib = library()
    if lib is None:
        return False
    if on is None:
        return bool(team_stats()["adaptive"])
    _adaptive = bool(on)
    return bool(lib.tm_team_adapt(int(on)))


def threads_adapt() -> bool:
    """adaptive_threads() without the library too (TOKENMILL_ADAPTIVE_THREADS or the last
    adaptive_threads(on)): whether engine steps follow the free cores."""
    return _adaptive


def team_stats() -> dict[str, int]:
    """The thread-team counters of this process since the library loaded (TEAM_STATS
    names them); empty without the library."""
    lib = library()
    if lib is None:
        return {}
    out = (ctypes.c_int64 * len(TEAM_STATS))()
    lib.tm_team_stats(out)
    return dict(zip(TEAM_STATS, out, strict=True))


def gemm_min_rows() -> int:
    """From how many rows of x `linear` multiplies packed weights by the integer GEMM
    (gemm.c) instead of the GEMV: 16 on AVX2 and 24 on AVX-512, where that measured
    faster, 0 where it never does (NEON, scalar)."""
    lib = library()
    return 0 if lib is None else lib.gemm_min_rows


def gemm_prefill() -> bool:
    """Whether prompts' products with packed weights run in the integer GEMM (inside
    `linear`) rather than as float32 tiles for torch's GEMM."""
    return gemm_min_rows() > 0


GEMV, GEMM, TILES, TORCH = "GEMV", "integer GEMM", "float32 tiles", "torch"
_PATH_NAMES = (GEMV, GEMM, TILES)  # tm_linear_path's TM_PATH_GEMV, _GEMM, _TILES


@dataclass(frozen=True)
class LinearPath:
    """How one product x [T, K] @ W^T runs, as the C side decides it (tm_linear_path)."""

    name: str  # GEMV, GEMM (the integer GEMM, inside `linear`), TILES (float32 tiles for
    # torch's GEMM: layers/native_linear.py) or TORCH (no native library)
    reason: str  # why, in one line: the row count against the build's thresholds


def _ask_path(lib: ctypes.CDLL, bits: int, rows: int) -> tuple[int, str]:
    reason = ctypes.create_string_buffer(200)
    path = lib.tm_linear_path(bits, min(rows, 2**31 - 1), 1, reason, len(reason))
    return path, reason.value.decode()


def linear_path(packed: bool, rows: int) -> LinearPath:
    """How a product of `rows` rows of x runs against packed weights (`packed`) or 16/32-bit
    float ones, on the loaded library: its tm_linear_path decides (the same function
    tm_linear asks between GEMV and GEMM); the tiles path is the caller's to run."""
    lib = library()
    if lib is None:
        return LinearPath(TORCH, "no native kernel library: weights converted by torch ops")
    key = (packed, rows)
    path = lib.linear_paths.get(key)
    if path is None:
        code, reason = _ask_path(lib, 8 if packed else F32, rows)
        path = lib.linear_paths[key] = LinearPath(_PATH_NAMES[code], reason)
    return path


def linear(
    w: TmWeight,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    act_bits: int = 8,
    rows: int | None = None,
) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W^T (+ bias); packed weights quantize the activations per
    32-block to `act_bits` (8: llama.cpp's scheme; 16: near-float accuracy), 16-bit
    float weights multiply x as float32. Packed weights go through the GEMV, or from
    `gemm_min_rows()` rows (where that is not 0) through the integer GEMM: the same
    integers, float sums in another order.

    x: contiguous float32; bias: [N] or None (made float32 if a loader cast it); rows: N
    of a chain of segments (tm_weight.next), whose first holds only its own rows.
    """
    return _product("tm_linear", w, x, bias, act_bits, rows or w.n)


def gemm(
    w: TmWeight, x: torch.Tensor, bias: torch.Tensor | None, act_bits: int = 16
) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W^T (+ bias) by the integer GEMM of gemm.c, for packed
    weights of one segment and any T, on any build (`linear` sends it gemm_min_rows()
    rows and more where that is not 0); the activations quantized like `linear`'s."""
    return _product("tm_gemm", w, x, bias, act_bits, w.n)


def _product(
    fn: str, w: TmWeight, x: torch.Tensor, bias: torch.Tensor | None, act_bits: int, rows: int
) -> torch.Tensor:
    lib = library()
    assert lib is not None, "call only when library() is not None"
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    T = x.shape[0]
    y = torch.empty(T, rows, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    threads, act16 = torch.get_num_threads(), int(act_bits == 16)
    ok = getattr(lib, fn)(
        ctypes.addressof(w), x.data_ptr(), T, y.data_ptr(), bias_ptr, threads, act16
    )
    _check(ok, fn)
    return y


def dequant_lanes(w: TmWeight, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) dequantized to [r1 - r0, K] float32, columns in lane order."""
    lib = library()
    assert lib is not None, "call only when library() is not None"
    out = torch.empty(r1 - r0, w.k, dtype=torch.float32)
    lib.tm_dequant_lanes(
        ctypes.addressof(w), r0, r1, out.data_ptr(), torch.get_num_threads()
    )  # fmt: skip
    return out


def lanes_f32(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 (contiguous) -> [T, K] with columns in lane order."""
    lib = library()
    assert lib is not None, "call only when library() is not None"
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.tm_lanes_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def dequant_rows(w: TmWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [n], contiguous) dequantized to [n, K] float32, natural order."""
    lib = library()
    assert lib is not None, "call only when library() is not None"
    out = torch.empty(ids.numel(), w.k, dtype=torch.float32)
    status = lib.tm_dequant_rows(ctypes.addressof(w), ids.data_ptr(), ids.numel(), out.data_ptr())
    if status == -1:
        raise IndexError(f"id out of range [0, {w.n})")
    if status == 0:
        raise MemoryError("tm_dequant_rows: cannot allocate scratch")
    return out


def pack_gguf(
    qtype: int,
    src: np.ndarray,
    k: int,
    codes: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray | None,
    sup: np.ndarray | None,
    as_8bit: bool = False,
) -> bool:
    """GGUF blocks src (uint8 [rows, row bytes], C-contiguous) of type `qtype` and k values
    per row into the packed arrays (C-contiguous, [rows, ...] each; pack.c says which
    shapes; as_8bit: Q5_0/Q5_1/Q5_K as 8-bit codes, Q6_K requantized to 8-bit blocks, where
    their own codes cannot run), in one pass. False where the
    loaded library does not pack that type or row length (the caller's numpy path does)."""
    lib = library()
    if lib is None:
        return False
    arrays = [a for a in (src, codes, scales, mins, sup) if a is not None]
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError("pack_gguf: arrays must be C-contiguous")
    status = lib.tm_pack_gguf(
        int(qtype), src.ctypes.data, src.shape[0], k, int(as_8bit), codes.ctypes.data,
        scales.ctypes.data,
        None if mins is None else mins.ctypes.data, None if sup is None else sup.ctypes.data,
        torch.get_num_threads(),
    )  # fmt: skip
    if status == -1:
        raise MemoryError("tm_pack_gguf: cannot allocate scratch")
    return status == 1


def decode_rows(
    positions: torch.Tensor,
    new_slots: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
) -> TmRows:
    """The C view of a step's decode rows: positions, new_slots, context_lens [Bd] and
    slots [Bd, Cmax], int64, contiguous, on CPU (the caller keeps them alive)."""
    return TmRows(
        positions.data_ptr(), new_slots.data_ptr(), slots.data_ptr(), context_lens.data_ptr(),
        positions.shape[0], slots.shape[1],
    )  # fmt: skip


def _check(status: int, what: str) -> None:
    if status == -1:
        raise ValueError(f"{what}: this kernel build cannot take this weight's format as stored")
    if status != 1:
        raise MemoryError(f"{what}: cannot allocate scratch")


def decode_attention(
    shape: TmShape, layer: TmLayer, rows: TmRows, qkv: torch.Tensor, out: torch.Tensor
) -> None:
    """Whole decode attention of one layer in one call (tm_decode_attention in attention.c):
    qkv [Bd, (H + 2 Hkv) hd] fused projection output -> out [Bd, H hd], float32 contiguous;
    also writes the rows' normed, rotated k and their v into the layer's cache."""
    lib = library()
    assert lib is not None, "call only when library() is not None"
    status = lib.tm_decode_attention(
        ctypes.addressof(shape), ctypes.addressof(layer), ctypes.addressof(rows),
        qkv.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _check(status, "tm_decode_attention")


def decode_stack(stack: TmStack, rows: TmRows, x: torch.Tensor) -> None:
    """Every layer's decode step and the final norm in one call (tm_decode_stack in
    stack.c), in place on x [Bd, d] (float32, contiguous)."""
    lib = library()
    assert lib is not None, "call only when library() is not None"
    status = lib.tm_decode_stack(
        ctypes.addressof(stack), ctypes.addressof(rows), x.data_ptr(), torch.get_num_threads()
    )
    _check(status, "tm_decode_stack")
