"""Hugging Face checkpoint folders: config.json + (sharded) safetensors, memory-mapped.

`.bin` checkpoints are pickles that can run code when loaded; they are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from tokenmill.config import ConfigError
from tokenmill.loader.checkpoint import Checkpoint, LoadError
from tokenmill.loader.checks import check_checkpoint, part_shape
from tokenmill.loader.hf_config import ConfigFields, from_hf_config

# HF parameter suffix (inside one decoder layer) -> tokenmill suffix.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn.q",
    "self_attn.k_proj": "attn.k",
    "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}
# MoE layers (layers/moe.py): HF suffix after `mlp.` (Qwen, OLMoE) or `block_sparse_moe.`
# (Mixtral before transformers 5) -> tokenmill suffix after `mlp.`
_MOE_NAMES = {
    "gate": "router",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "shared_expert_gate": "shared_gate",
}
# Phi-3's fused projections -> the parts the model already has (split at load by
# phi3_rows, so every path sees the same q/k/v and gate/up weights as Llama's).
_PHI3_FUSED = {
    "self_attn.qkv_proj": ("attn.q", "attn.k", "attn.v"),
    "mlp.gate_up_proj": ("mlp.gate", "mlp.up"),
}
_GPT2_LAYER_NAMES = {
    "ln_1": "attn_norm",
    "attn.c_proj": "attn.o",
    "ln_2": "mlp_norm",
    "mlp.c_fc": "mlp.up",
    "mlp.c_proj": "mlp.down",
}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LoadError(path, f"invalid JSON: {e.msg} at line {e.lineno}") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise LoadError(path, f"unreadable JSON ({type(e).__name__})") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map", {}) if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise LoadError(index, "weight_map must map tensor names to shard file names")
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if f.parent != folder or f.name in ("", ".", ".."):
                raise LoadError(index, f"shard {f.name!r} is not a file in the folder")
            if not f.is_file():
                raise LoadError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
            raise LoadError(
                folder, "only pickle (.bin/.pt) weights found; tokenmill loads safetensors only"
            )
        raise LoadError(folder, "no *.safetensors weights found")
    return files


def _map_name(
    name: str, arch: str, sandwich: bool, num_experts: int = 0
) -> list[tuple[str, str | tuple | None]]:
    """tokenmill name(s) for one HF tensor name; [] for tensors tokenmill does not use.
    With each, the part of the tensor it is: None (all of it), "q"/"k"/"v" (GPT-2's fused
    QKV) or (expert, half) of a 3-D expert tensor (_expert_shape)."""
    for prefix in ("model.language_model.", "language_model.model.", "transformer.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if arch == "gpt2":
        top = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight"}
        if name in top:
            return [(top[name], None)]
        if name.startswith("ln_f."):
            return [("final_norm." + name[5:], None)]
        if name.startswith("lm_head."):
            return [(name, None)]
    else:
        if name == "embed_tokens.weight":
            return [("embed.weight", None)]
        if name.startswith("norm."):
            return [("final_norm." + name[5:], None)]
        if name.startswith("lm_head."):
            return [(name, None)]
    if not (name.startswith("layers.") or name.startswith("h.")):
        return []
    _, idx, rest = name.split(".", 2)
    stem, _, kind = rest.rpartition(".")
    if arch == "gpt2":
        if stem == "attn.c_attn":  # fused QKV, split by the caller's slices
            return [(f"layers.{idx}.attn.{p}.{kind}", p) for p in ("q", "k", "v")]
        mapped = _GPT2_LAYER_NAMES.get(stem)
    elif num_experts and (moe := _moe_name(rest, num_experts, arch)) is not None:
        return [(f"layers.{idx}.mlp.{target}", part) for target, part in moe]
    elif rest == "self_attn.sinks":  # gpt-oss: one logit per query head [H]
        return [(f"layers.{idx}.attn.sinks", None)]
    elif arch == "phi3" and stem in _PHI3_FUSED:
        return [(f"layers.{idx}.{p}.{kind}", p) for p in _PHI3_FUSED[stem]]
    elif stem == "post_attention_layernorm":
        # Gemma's sandwich: a norm after attention; elsewhere: the norm before the MLP.
        mapped = "post_attn_norm" if sandwich else "mlp_norm"
    else:
        mapped = _LAYER_NAMES.get(stem)
    return [(f"layers.{idx}.{mapped}.{kind}", None)] if mapped else []


def _moe_name(rest: str, num_experts: int, arch: str) -> list[tuple[str, tuple | None]] | None:
    """A sparse layer's tensor (`rest`: the name after `layers.i.`) -> [(suffix after
    `mlp.`, part)], or None when `rest` is not one (a dense layer's MLP, attention)."""
    if rest in ("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"):
        # Granite-MoE-shared: [2fs, d] rows [gate; up], and [d, fs]
        if rest.endswith("output_linear.weight"):
            return [("shared.down.weight", None)]
        return [(f"shared.{p}.weight", (None, h)) for h, p in enumerate(("gate", "up"))]
    for prefix in ("mlp.", "block_sparse_moe."):
        if rest.startswith(prefix):
            rest = rest[len(prefix) :]
            break
    else:
        return None
    if arch == "gpt_oss":
        return _gpt_oss_moe_name(rest, num_experts)
    # Granite-MoE's names for the same tensors: input_linear [E, 2fe, d] rows [gate; up] per
    # expert, output_linear [E, d, fe], and the router's router.layer [E, d]
    rest = {
        "input_linear.weight": "experts.gate_up_proj",
        "output_linear.weight": "experts.down_proj",
        "router.layer.weight": "gate.weight",
        "router.weight": "gate.weight",
    }.get(rest, rest)
    if rest in ("experts.gate_up_proj", "experts.down_proj"):
        # transformers 5 in memory (save_original_format=False): [E, 2fe, d] rows [gate; up]
        # per expert, and [E, d, fe]
        if rest == "experts.down_proj":
            return [(f"experts.{j}.down.weight", (j, None)) for j in range(num_experts)]
        return [
            (f"experts.{j}.{p}.weight", (j, h))
            for j in range(num_experts)
            for h, p in enumerate(("gate", "up"))
        ]
    stem, _, kind = rest.rpartition(".")
    if stem.startswith("experts.") or stem.startswith("shared_expert."):
        group, _, proj = stem.rpartition(".")
        group = "shared" if group == "shared_expert" else group  # experts.j stays
        mapped = _MOE_NAMES.get(proj)
        return [(f"{group}.{mapped}.{kind}", None)] if mapped in ("gate", "up", "down") else []
    if stem in ("gate", "shared_expert_gate"):
        return [(f"{_MOE_NAMES[stem]}.{kind}", None)]
    return None


def _gpt_oss_moe_name(rest: str, num_experts: int) -> list[tuple[str, tuple | None]] | None:
    """gpt-oss's experts, all in 3-D tensors stored [in, out] with gate and up interleaved
    along `out`: gate_up_proj [E, d, 2fe] (gate in the even columns, up in the odd ones),
    its bias [E, 2fe], down_proj [E, fe, d] and its bias [E, d]. Each expert's part is
    (j, half, "oss"): transposed to [out, in] and deinterleaved at load (_loader)."""
    if rest in ("router.weight", "router.bias"):
        return [(rest, None)]
    if rest.endswith("_scales"):  # MXFP4: read with its _blocks (_mxfp4_blocks)
        return []
    if rest.endswith("_blocks"):  # MXFP4 (the released checkpoints): [E, out, in / 32, 16]
        stem = rest.removesuffix("_blocks")
        if stem == "experts.down_proj":
            return [(f"experts.{j}.down.weight", (j, None, "mxfp4")) for j in range(num_experts)]
        if stem == "experts.gate_up_proj":  # out: gate and up rows interleaved
            return [
                (f"experts.{j}.{p}.weight", (j, h, "mxfp4"))
                for j in range(num_experts)
                for h, p in enumerate(("gate", "up"))
            ]
        return None
    kind = "bias" if rest.endswith("_bias") else "weight"
    stem = rest.removesuffix("_bias")
    if stem == "experts.down_proj":
        return [(f"experts.{j}.down.{kind}", (j, None, "oss")) for j in range(num_experts)]
    if stem == "experts.gate_up_proj":
        return [
            (f"experts.{j}.{p}.{kind}", (j, h, "oss"))
            for j in range(num_experts)
            for h, p in enumerate(("gate", "up"))
        ]
    return None


def _expert_shape(path: Path, key: str, shape: tuple[int, ...], part: tuple):
    """The shape of expert j's slice (of half h: 0 gate, 1 up) of a 3-D expert tensor
    (a 2-D bias tensor [E, n] for gpt-oss); j None: half h of a 2-D [gate; up] tensor."""
    if part[0] is None:
        if len(shape) != 2 or shape[0] % 2:
            raise LoadError(path, f"tensor {key}: shape {shape} is not [2 rows, cols]")
        return (shape[0] // 2, shape[1])
    if len(part) == 3 and part[2] == "mxfp4":  # [E, out, in / 32, 16], halves interleaved
        j, half, _ = part
        if (
            len(shape) != 4
            or shape[3] != 16
            or j >= shape[0]
            or (half is not None and shape[1] % 2)
        ):
            raise LoadError(path, f"tensor {key}: shape {shape} is not [experts, out, in/32, 16]")
        return (shape[1] if half is None else shape[1] // 2, shape[2] * 32)
    if len(part) == 3:  # gpt-oss: [E, in, out] or [E, out] (bias), halves interleaved
        j, half, _ = part
        if len(shape) not in (2, 3) or j >= shape[0] or (half is not None and shape[-1] % 2):
            raise LoadError(path, f"tensor {key}: shape {shape} is not [experts, in, out]")
        out = shape[-1] if half is None else shape[-1] // 2
        return (out,) if len(shape) == 2 else (out, shape[1])
    j, half = part
    if len(shape) != 3 or j >= shape[0] or (half is not None and shape[1] % 2):
        raise LoadError(path, f"tensor {key}: shape {shape} is not [experts, rows, cols]")
    rows = shape[1] if half is None else shape[1] // 2
    return (rows, shape[2])


def open_folder(folder: Path) -> Checkpoint:
    """A folder that sniff_format has found to have a config.json (open_checkpoint)."""
    cfg_path = folder / "config.json"
    raw = _read_json(cfg_path)
    gen_path = folder / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.exists() else {}
    try:
        config = from_hf_config(raw)
    except ConfigError as e:
        raise LoadError(cfg_path, str(e)) from None
    try:
        eos = ConfigFields(generation, "generation_config.json").ids("eos_token_id")
    except ConfigError as e:
        raise LoadError(gen_path, str(e)) from None
    if eos:
        config.eos_token_ids = eos

    tensors, shapes, raw_tensors = {}, {}, {}
    handles: dict[str, Any] = {}  # every tensor's file (an MXFP4 _blocks reads its _scales)
    for file in _safetensors_files(folder):
        try:
            handle = safe_open(str(file), framework="pt")
            keys = list(handle.keys())
            header = {key: tuple(handle.get_slice(key).get_shape()) for key in keys}
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise LoadError(file, f"unreadable safetensors file ({e})") from None
        for key in keys:
            handles[key] = handle
            names = _map_name(key, config.arch, config.sandwich_norm, config.num_experts)
            for target, part in names:
                tensors[target] = _loader(handle, file, key, config, part)
                if isinstance(part, tuple) and part[-1] == "mxfp4":
                    tensors[target], raw_tensors[target] = _mxfp4_loaders(
                        handles, file, key, part, header[key]
                    )
                if isinstance(part, tuple):
                    shapes[target] = _expert_shape(file, key, header[key], part)
                    continue
                shape = _our_shape(key, header[key], config)
                if config.arch == "phi3" and part is not None:
                    start, stop = phi3_rows(file, key, shape, config, part)
                    shapes[target] = (stop - start, *shape[1:])
                else:
                    shapes[target] = part_shape(file, key, shape, part)
    ckpt = Checkpoint(folder, "hf", config, tensors, generation, raw=raw_tensors, shapes=shapes)
    check_checkpoint(ckpt, layer_key="n_layer" if config.arch == "gpt2" else "num_hidden_layers")
    return ckpt


def _our_shape(key: str, shape: tuple[int, ...], config) -> tuple[int, ...]:
    """The shape `_loader` gives tensor `key` (GPT-2's [in, out] matrices transposed)."""
    if config.arch == "gpt2" and len(shape) == 2 and "wte" not in key and "wpe" not in key:
        return shape[::-1]
    return shape


def phi3_rows(file: Path, key: str, shape: tuple[int, ...], config, part: str) -> tuple[int, int]:
    """Rows [start, stop) of Phi-3's fused tensor `key` that hold `part`: qkv_proj is [q;
    k; v] ([q_size + 2 kv_size, d]), gate_up_proj [gate; up] ([2f, d]); GGUF's attn_qkv
    and ffn_up hold the same rows (loader/gguf_file.py)."""
    rows = shape[0] if shape else 0
    q, kv, f = config.q_size, config.kv_size, config.intermediate_size
    bounds = {
        "attn.q": (0, q, q + 2 * kv),
        "attn.k": (q, q + kv, q + 2 * kv),
        "attn.v": (q + kv, q + 2 * kv, q + 2 * kv),
        "mlp.gate": (0, f, 2 * f),
        "mlp.up": (f, 2 * f, 2 * f),
    }
    start, stop, total = bounds[part]
    if rows != total:
        raise LoadError(file, f"tensor {key}: fused with {rows} rows, expected {total}")
    return start, stop


def _mxfp4_loaders(handles: dict, file: Path, key: str, part: tuple, shape: tuple):
    """(float loader, raw loader) of one expert projection stored MXFP4 as gpt-oss's
    released checkpoints store it (config quantization_config.quant_method "mxfp4"):
    `key` (..._blocks) uint8 [E, out, in / 32, 16], two e2m1 codes a byte (value 2i in
    the low nibble of byte i), and its ..._scales uint8 [E, out, in / 32], e8m0 exponents
    (2^(s - 127)). Both give GGUF's MXFP4 blocks: the raw loader (GGUF MXFP4, [rows,
    in / 32 * 17]) packs as a GGUF file's MXFP4 tensors do, the float one dequantizes
    them with gguf-py; rows are expert j's (of half h: gate = even rows, up = odd)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    j, half, _ = part
    scales_key = key.removesuffix("_blocks") + "_scales"

    def blocks() -> np.ndarray:
        if scales_key not in handles:
            raise LoadError(file, f"tensor {key!r} has no {scales_key!r} beside it")
        try:
            codes = handles[key].get_slice(key)[j : j + 1][0]  # [out, G, 16] uint8
            scales = handles[scales_key].get_slice(scales_key)[j : j + 1][0]  # [out, G]
        except Exception as e:
            raise LoadError(file, f"cannot read tensor {key!r} ({e})") from None
        if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise LoadError(file, f"tensor {key!r}: MXFP4 blocks and scales must be uint8")
        if tuple(scales.shape) != tuple(codes.shape[:2]):
            raise LoadError(
                file, f"tensor {scales_key!r}: shape {tuple(scales.shape)} does not match "
                f"{key!r}'s {tuple(codes.shape)}"
            )  # fmt: skip
        if half is not None:
            codes, scales = codes[half::2], scales[half::2]
        codes = codes.numpy()
        # values in order [rows, G, 32]; GGUF's byte i holds value i (low) and i + 16 (high)
        values = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:2], 32)
        qs = values[..., :16] | (values[..., 16:] << 4)  # [rows, G, 16]
        packed = np.concatenate([scales.numpy()[..., None], qs], axis=-1)  # [rows, G, 17]
        return packed.reshape(packed.shape[0], -1)

    def load_float() -> torch.Tensor:
        rows = dequantize(blocks(), GGMLQuantizationType.MXFP4)
        return torch.from_numpy(np.ascontiguousarray(rows.reshape(rows.shape[0], -1)))

    return load_float, lambda: (GGMLQuantizationType.MXFP4, blocks())


def _loader(handle, file: Path, key: str, config, part):
    """A thunk reading one tensor, converted to tokenmill's layout."""

    def load() -> torch.Tensor:
        try:
            if isinstance(part, tuple) and len(part) == 3:  # gpt-oss: [in, out], interleaved
                j, half, _ = part
                t = handle.get_slice(key)[j : j + 1][0]  # [in, out] or a bias [out]
                t = t if half is None else t[..., half::2]
                return t.t().contiguous() if t.dim() == 2 else t.contiguous()
            if isinstance(part, tuple) and part[0] is None:  # half of [gate; up] [2f, d]
                return handle.get_tensor(key).chunk(2, dim=0)[part[1]].contiguous()
            if isinstance(part, tuple):  # one expert of a 3-D tensor: read only its rows
                j, half = part
                t = handle.get_slice(key)[j : j + 1][0]
                return t if half is None else t.chunk(2, dim=0)[half].contiguous()
            t = handle.get_tensor(key)
        except Exception as e:
            raise LoadError(file, f"cannot read tensor {key!r} ({e})") from None
        if config.arch == "gpt2" and t.dim() == 2 and "wte" not in key and "wpe" not in key:
            t = t.t()  # GPT-2's Conv1D stores [in, out]; tokenmill uses [out, in]
        if part is not None and config.arch == "phi3":  # fused qkv_proj / gate_up_proj
            start, stop = phi3_rows(file, key, tuple(t.shape), config, part)
            t = t[start:stop]
        elif part is not None:  # GPT-2 fused c_attn: rows [q; k; v]
            i = "qkv".index(part)
            t = t.chunk(3, dim=0)[i]
        if config.arch in ("gemma2", "gemma3") and key.endswith("norm.weight"):
            t = t.float() + 1.0  # Gemma scales by (1 + w); fold the 1 in once at load
        return t

    return load
