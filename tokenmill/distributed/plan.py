"""How a model is cut across ranks: which heads, MLP columns, vocabulary rows and layers
each rank holds. Pure arithmetic on the config, no torch.distributed.

Tensor parallelism (Megatron-style, as vLLM and nano-vllm do it):

    column-parallel  Q, K, V (by heads) and gate, up (by MLP columns): each rank computes
                     its slice of the output, nothing to combine
    row-parallel     the output projection and the down projection take the rank's slice
                     of their input; each rank's product is a partial sum: all-reduce
    vocabulary       embedding and un-embedding rows split by token id: an embedding row
                     comes from the rank that holds it (all-reduce of masked lookups), the
                     logits are gathered

Heads go in whole K/V groups (a group: one K/V head and the query heads sharing it), so
every rank's attention is the ordinary GQA of a smaller model; groups are dealt out as
evenly as they divide (SmolLM2's 3 groups on 2 ranks: 2 and 1). With fewer K/V heads
than ranks, each K/V head is replicated on N/Hkv ranks and its query heads split between
them. MLP columns are cut on 256-value boundaries when the width allows (K-quant blocks),
else 32 (the other block formats).

Pipeline parallelism: consecutive layers per stage, balanced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.config import ModelConfig


class PlanError(ValueError):
    """The model cannot be cut this way (the message says why)."""


def split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, end) of `parts` consecutive ranges covering n, as even as `align` allows
    (every cut a multiple of align; the remainder of n beyond a multiple goes last)."""
    units, tail = divmod(n, align)
    if units < parts:
        raise PlanError(f"cannot cut {n} into {parts} parts of whole {align}s")
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for p in range(parts):
        size = (base + (p < extra)) * align + (tail if p == parts - 1 else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


@dataclass(frozen=True)
class TPShard:
    """What one tensor-parallel rank holds: [start, end) ranges of the full model's."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]  # columns of the MLP's intermediate size
    vocab: tuple[int, int]  # token ids of the embedding and the un-embedding

    def describe(self, head_dim: int) -> str:
        q0, q1 = self.q_heads
        k0, k1 = self.kv_heads
        return (
            f"rank {self.rank}: query heads {q0}-{q1 - 1}, K/V heads {k0}-{k1 - 1}, "
            f"MLP columns {self.mlp[0]}-{self.mlp[1] - 1}, vocabulary {self.vocab[0]}-{self.vocab[1] - 1}"
        )


def tp_plan(cfg: ModelConfig, size: int) -> list[TPShard]:
    """The shard of every rank, for tensor parallelism over `size` ranks."""
    if size < 1:
        raise PlanError("tensor_parallel_size must be at least 1")
    if cfg.num_experts:
        # every rank would hold every expert and the all-reduce would add them `size` times
        raise PlanError(
            "tensor parallelism does not shard Mixture-of-Experts layers yet: "
            "use pipeline_parallel_size (or one process) for this model"
        )
    if cfg.qk_norm == "full" and size > 1:
        # OLMo 2's q/k norms take the RMS over every head; a rank holds only its own heads
        raise PlanError(
            "tensor parallelism does not cut a Q/K norm over the whole projection "
            "(qk_norm 'full', OLMo 2) yet: use pipeline_parallel_size for this model"
        )
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    rep = H // Hkv
    if Hkv >= size:
        groups = split(Hkv, size)
        heads = [((g0 * rep, g1 * rep), (g0, g1)) for g0, g1 in groups]
    elif size % Hkv == 0:  # replicate each K/V head on size/Hkv ranks, split its queries
        per = size // Hkv
        if rep < per:
            raise PlanError(f"{H} query heads cannot be dealt to {size} ranks")
        heads = []
        for r in range(size):
            g, part = divmod(r, per)
            a, b = split(rep, per)[part]
            heads.append(((g * rep + a, g * rep + b), (g, g + 1)))
    else:
        raise PlanError(
            f"tensor_parallel_size {size} must divide or be a multiple of the {Hkv} K/V heads"
        )
    f = cfg.intermediate_size
    align = 256 if f % 256 == 0 and f // 256 >= size else 32
    mlp = split(f, size, align)
    vocab = split(cfg.vocab_size, size)
    return [TPShard(r, size, heads[r][0], heads[r][1], mlp[r], vocab[r]) for r in range(size)]


def tp_local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config of the smaller model a rank runs: its heads, MLP columns, vocabulary."""
    return replace(
        cfg,
        num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.mlp[1] - shard.mlp[0],
        vocab_size=shard.vocab[1] - shard.vocab[0],
        layer_types=list(cfg.layer_types),
    )


@dataclass(frozen=True)
class PPStage:
    """What one pipeline stage holds: layers [start, end), and the ends of the model."""

    rank: int
    size: int
    layers: tuple[int, int]

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def describe(self) -> str:
        parts = [f"layers {self.layers[0]}-{self.layers[1] - 1}"]
        if self.first:
            parts.insert(0, "embedding")
        if self.last:
            parts.append("final norm and un-embedding")
        return f"stage {self.rank}: " + ", ".join(parts)


def pp_plan(cfg: ModelConfig, size: int) -> list[PPStage]:
    if size < 1:
        raise PlanError("pipeline_parallel_size must be at least 1")
    if cfg.num_layers < size:
        raise PlanError(f"{cfg.num_layers} layers cannot fill {size} pipeline stages")
    return [PPStage(r, size, rng) for r, rng in enumerate(split(cfg.num_layers, size))]


def pp_local_config(cfg: ModelConfig, stage: PPStage) -> ModelConfig:
    return cfg.layers_slice(*stage.layers)
