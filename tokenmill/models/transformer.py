"""The one transformer every family runs on, configured by ModelConfig.

    token ids [T]
      -> embedding lookup [T, d]  (x sqrt(d) for Gemma; + learned positions for GPT-2)
      -> N x Block:  x + Attention(norm(x)),  x + MLP(norm(x))
                     (Gemma adds a norm after each sublayer too: "sandwich" norms;
                     OLMo 2 has only those: x + norm(Attention(x)), x + norm(MLP(x)))
      -> final norm -> un-embedding [B, vocab] (only at the rows that need logits)

Parameter names (what the loaders produce; loader/shapes.py gives each one's shape):
    embed.weight [V, d]        pos_embed.weight [P, d]      final_norm.{weight,bias}
    lm_head.weight [V, d] (untied only)
    layers.i.{attn_norm, post_attn_norm, mlp_norm, post_mlp_norm}.{weight,bias}
    layers.i.attn.{q,k,v,o}.{weight,bias}   layers.i.attn.{q_norm,k_norm}.weight
    layers.i.mlp.{gate,up,down}.{weight,bias}
    sparse layers instead: layers.i.mlp.{router, experts.j.{gate,up,down}, shared.*,
    shared_gate} (layers/moe.py)
The model fuses q/k/v into `attn.qkv` and gate/up into `mlp.up`; `load_weights`
concatenates the checkpoint's tensors into them (see FUSED).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.config import ModelConfig
from tokenmill.layers.attention import Attention, AttentionMetadata, NativeStep
from tokenmill.layers.linear import Linear
from tokenmill.layers.mlp import MLP
from tokenmill.layers.moe import MoE
from tokenmill.layers.native_linear import NativeLinear
from tokenmill.layers.norm import make_norm
from tokenmill.layers.rotary import Rotary
from tokenmill.loader import Checkpoint, LoadError
from tokenmill.models import paths
from tokenmill.models.native_model import NativeModel
from tokenmill.models.quantize import quantize_model

# A fused parameter -> the checkpoint tensors stacked (along rows) to make it.
FUSED = {
    "attn.qkv": ("attn.q", "attn.k", "attn.v"),
    "mlp.up": ("mlp.gate", "mlp.up"),
}


def checkpoint_parts(name: str, gated_mlp: bool) -> list[str]:
    """The checkpoint tensor names that make model parameter `name` (in row order)."""
    stem, sep, kind = name.rpartition(".up.")
    if sep and (".mlp.experts." in stem or stem.endswith(".mlp.shared")):
        return [f"{stem}.gate.{kind}", f"{stem}.up.{kind}"]  # an MoE expert's [gate; up]
    for fused, parts in FUSED.items():
        layer, sep, suffix = name.partition(f".{fused}.")
        if sep:
            if fused == "mlp.up" and not gated_mlp:
                return [name]  # GPT-2's plain MLP: `up` is just the checkpoint's up
            return [f"{layer}.{p}.{suffix}" for p in parts]
    return [name]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rotary: Rotary | None):
        super().__init__()
        d = cfg.hidden_size
        # OLMo 2 (pre_norm False): no norm before the sublayers, only the ones after them
        pre = cfg.pre_norm
        self.attn_norm = make_norm(cfg.norm, d, cfg.norm_eps) if pre else None
        self.attn = Attention(cfg, idx, rotary)
        self.mlp_norm = make_norm(cfg.norm, d, cfg.norm_eps) if pre else None
        # a sparse layer's MoE (layers/moe.py) or the dense MLP
        self.mlp = MoE(cfg, idx) if cfg.moe_layers[idx] else MLP(cfg)
        self.post_attn_norm = make_norm(cfg.norm, d, cfg.norm_eps) if cfg.sandwich_norm else None
        self.post_mlp_norm = make_norm(cfg.norm, d, cfg.norm_eps) if cfg.sandwich_norm else None
        self.residual_scale = cfg.residual_scale  # Granite: x + s * sublayer(x)
        self.tp = None  # tensor parallelism: the rank's TPGroup (distributed/group.py)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.attn(x if self.attn_norm is None else self.attn_norm(x), meta)
        x = self._residual(x, h, self.post_attn_norm, "attention", meta)
        h = x if self.mlp_norm is None else self.mlp_norm(x)
        # an MoE layer hands its router's choice to the trace (ForwardHooks.on_router)
        h = self.mlp(h, meta) if isinstance(self.mlp, MoE) else self.mlp(h)
        return self._residual(x, h, self.post_mlp_norm, "mlp", meta)

    def _residual(
        self, x: torch.Tensor, h: torch.Tensor, post_norm, site: str, meta: AttentionMetadata
    ) -> torch.Tensor:
        """x + a sublayer's output h (both [T, d]), after the sublayer's last steps."""
        if self.tp is not None:  # its last projection (o or down) was row-parallel: sum ranks'
            self.tp.all_reduce(h)
        if post_norm is not None:  # Gemma 2/3 and OLMo 2 norm the output before the add
            h = post_norm(h)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        x = x + h
        if meta.trace is not None:
            meta.trace.hooks.on_residual(meta, self.attn.layer_idx, site, x)
        return x


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d, _weight=torch.empty(cfg.vocab_size, d))
        self.embed.weight.requires_grad_(False)
        self.pos_embed = None
        rotary = rotary_local = None
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(
                cfg.max_position, d, _weight=torch.empty(cfg.max_position, d)
            )
            self.pos_embed.weight.requires_grad_(False)
        else:
            rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position)
            if cfg.rope_local is not None:
                rotary_local = Rotary(cfg.rope_local, cfg.head_dim, cfg.max_position)
        self.rotary, self.rotary_local = rotary, rotary_local
        self.layers = nn.ModuleList(
            Block(cfg, i, self._layer_rotary(i)) for i in range(cfg.num_layers)
        )
        self.final_norm = make_norm(cfg.norm, d, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(d, cfg.vocab_size)
        self.dtype = torch.float32  # activation dtype; set by load_weights
        # The native kernels' view of the model (models/native_model.py), built at first
        # use: the runner attaches the KV cache after construction.
        self._native: NativeModel | None = None
        self._paths_seen: set[paths.DecodePath] = set()  # logged once each (paths.choose)
        # called before each layer of a step run layer by layer (prompts): the engine
        # re-decides its threads there, as a long step may outlast a neighbour's burst
        self.before_layer: Callable[[], None] | None = None
        # Parallel runs (tokenmill/distributed): the rank's TPGroup, or the pipeline stage
        # this model is (the embedding only on the first, the head only on the last).
        self.tp = None
        self.stage = None

    def _layer_rotary(self, i: int) -> Rotary | None:
        """Layer i's RoPE: none for SmolLM3's NoPE layers, Gemma 3's local tables for its
        sliding layers, else the model's."""
        if not self.cfg.rope_layers[i]:
            return None
        if self.cfg.layer_types[i] == "sliding" and self.rotary_local is not None:
            return self.rotary_local
        return self.rotary

    def set_tensor_parallel(self, tp) -> None:
        """Make this (sharded) model one rank of a tensor-parallel group."""
        self.tp = tp
        for layer in self.layers:
            layer.tp = tp
        self._native = None

    def set_pipeline_stage(self, stage) -> None:
        """Keep only what pipeline stage `stage` runs: its layers are this model's; the
        embedding stays on the first stage (and the last, when tied to the head), the
        final norm and the head on the last."""
        self.stage = stage
        tied = self.lm_head is None
        if not stage.first:
            self.pos_embed = None
            if not (stage.last and tied):
                self.embed = None
        if not stage.last:
            self.final_norm = self.lm_head = None
        self._native = None

    # ------------------------------------------------------------------
    # forward: packed tokens of a batch -> logits at the requested rows
    # ------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,  # [B] rows to un-embed; None = all rows
        hidden: torch.Tensor | None = None,  # [T, d]: a later pipeline stage's input
        head: bool = True,  # False: the final-norm hidden states [B, d] instead of logits
    ) -> torch.Tensor:
        """logits [B, vocab] of the rows that sample (or of every row); a pipeline stage
        before the last returns its hidden states [T, d] for the next stage instead.
        head=False (embeddings, engine/pooling.py) stops after the final norm."""
        if hidden is not None:
            x = hidden
        else:
            x = self.embed_tokens(input_ids)  # [T, d]
            if self.cfg.embed_scale != 1.0:
                # Gemma: scale computed in the activation dtype, as the reference does.
                x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
            if self.pos_embed is not None:
                x = x + self.pos_embed(meta.positions)
            if meta.trace is not None:
                meta.trace.hooks.on_embedding(meta, input_ids, x)
        last = self.final_norm is not None
        # ---- which code runs the decode rows (models/paths.py) ----
        path = paths.choose(self, meta, x.shape[0])
        if path.name != paths.TORCH:
            rows = kernels.decode_rows(
                meta.positions[: meta.num_decode], meta.slot_mapping[: meta.num_decode],
                meta.decode_slots, meta.decode_context_lens,
            )  # fmt: skip
            meta = replace(meta, native=NativeStep(self.native_model(), rows))
        if path.name == paths.STACK:
            # every layer and the final norm in one native call; all decode rows sample
            x = meta.native.model.run_stack(x, meta.native.rows)
            if not head:  # the stack's rows are all T rows, final norm included
                return x if logits_rows is None else x[logits_rows]
            return self.unembed(x) if last else x
        for layer in self.layers:
            if self.before_layer is not None:
                self.before_layer()
            x = layer(x, meta)
        if not last:
            return x
        if logits_rows is not None:
            x = x[logits_rows]  # [B, d]: only the rows whose next token we sample
        x = self.final_norm(x)
        return self.unembed(x) if head else x

    def attach_kv_cache(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Give each layer its view of the cache pool ([num_slots, Hkv, hd] per layer)."""
        for layer, k_layer, v_layer in zip(self.layers, k, v, strict=True):
            layer.attn.k_cache, layer.attn.v_cache = k_layer, v_layer
        self._native = None

    def native_model(self) -> NativeModel:
        """The native kernels' descriptors of this model (built once, after the cache)."""
        if self._native is None:
            self._native = NativeModel(self)
        return self._native

    def decode_path(self) -> paths.DecodePath:
        """The path an untraced step of decode rows only takes (models/paths.py)."""
        return paths.best_decode_path(self)

    def _apply(self, fn, recurse=True):
        self._native = None  # weights or caches may move: rebuild the native description
        return super()._apply(fn, recurse)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # each rank holds a range of the vocabulary
            return self.tp.embed(self._embed_rows, ids)
        return self._embed_rows(ids)

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, NativeLinear):
            return self.embed.embed(ids).to(self.dtype)
        return self.embed(ids)

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """[B, d] -> [B, vocab] float32 logits."""
        head = self.embed if self.lm_head is None else self.lm_head
        if isinstance(head, nn.Embedding):
            logits = (x @ head.weight.t()).float()
        else:  # Linear, QuantLinear or FloatLinear
            logits = head(x).float()
        if self.cfg.logit_scale != 1.0:  # Granite: logits / logits_scaling
            logits = logits * self.cfg.logit_scale
        cap = self.cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.tp is not None:  # each rank computed its range of the vocabulary
            logits = self.tp.gather_logits(logits)
        return logits

    # ------------------------------------------------------------------
    # weights
    # ------------------------------------------------------------------
    def load_weights(
        self,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        progress=None,
        quantize: str | None = None,
    ) -> None:
        """Fill every parameter from the checkpoint; one clear error for any mismatch.

        quantize: None keeps float weights in `dtype`; "gguf", "float", "q8" or "q4" swaps
        the projections for layers the native kernels read as stored (QuantLinear,
        FloatLinear) first (see models/quantize.py).
        progress(done, total) is called after each tensor.
        """
        self.dtype = dtype
        gated = self.cfg.mlp == "gated"
        released: list[str] = []
        if quantize is not None:
            released = quantize_model(
                self, ckpt, quantize, lambda name: checkpoint_parts(name, gated)
            )
        params = dict(self.named_parameters())
        tensors = dict(ckpt.tensors)
        if (
            "embed.weight" in tensors
            and self.lm_head is not None
            and "lm_head.weight" not in tensors
        ):
            tensors["lm_head.weight"] = tensors["embed.weight"]  # tied in the file, not the config
        plan = {name: checkpoint_parts(name, gated) for name in params}
        missing = [p for parts in plan.values() for p in parts if p not in tensors]
        if missing:
            raise LoadError(ckpt.path, f"missing tensor {missing[0]!r} ({len(missing)} missing)")
        for done, (name, param) in enumerate(params.items(), 1):
            pieces = [tensors[p]() for p in plan[name]]
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
            if tuple(t.shape) != tuple(param.shape):
                shown = plan[name][0] if len(pieces) == 1 else "+".join(plan[name])
                raise LoadError(
                    ckpt.path,
                    f"tensor {shown!r} has shape {tuple(t.shape)}, expected {tuple(param.shape)}",
                )
            keep_fp32 = name.endswith("norm.weight") or name.endswith("norm.bias")
            param.data = t.to(torch.float32 if keep_fp32 else dtype).contiguous()
            if progress is not None:
                progress(done, len(params))
        if "rope_freqs" in tensors and self.rotary is not None:
            self.rotary.set_freq_factors(tensors["rope_freqs"]())
        # Reading a tensor can map packed neighbours' released pages back: the kernel maps
        # the whole large folio of the page cache around a fault (fault-around), so the
        # float tensors read after packing, scattered between the packed ones, brought
        # ~20 MiB of them back. One more sweep drops them.
        for name in released:
            ckpt.release(name)
