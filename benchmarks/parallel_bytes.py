"""Bytes one decode token moves between ranks, tensor vs pipeline parallelism, from the
shapes tokenmill's own code uses (ModelConfig, distributed/plan.py).

    python benchmarks/parallel_bytes.py [--ranks 2]

Per generated token (batch 1), counted as the bytes each rank sends:
  tensor parallel   every layer: two all-reduces of the hidden state [d] (after the output
                    and the down projection); the embedding row's all-reduce; the logits
                    gather (each rank's vocabulary range to rank 0). A ring all-reduce
                    sends 2 (N-1)/N of the buffer per rank.
  pipeline parallel one hidden state [d] per stage boundary, then the logits [vocab] from
                    the last stage back to rank 0, where the sampler runs.
Float32 activations (tokenmill's), and the number of messages, whose latency dominates
on a real network: 2 per layer and stage for tensor parallelism, 1 per stage boundary
for pipeline parallelism.
"""

from __future__ import annotations

import argparse

from tokenmill.config import ModelConfig

SHAPES = {
    "SmolLM2-135M (default)": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64),
    "Llama-3.2-1B": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64),
    "Llama-3.1-8B": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128),
}


def per_token(cfg: ModelConfig, ranks: int) -> dict[str, float]:
    f32, ring = 4, 2 * (ranks - 1) / ranks
    hidden = cfg.hidden_size * f32
    vocab_share = cfg.vocab_size * f32 * (ranks - 1) / ranks
    tp = 2 * cfg.num_layers * hidden * ring + hidden * ring + vocab_share
    pp_hidden = (ranks - 1) * hidden
    return {
        "tp_bytes": tp,
        "tp_messages": 2 * cfg.num_layers + 2,
        "pp_bytes": pp_hidden + cfg.vocab_size * f32,
        "pp_bytes_sampling_on_last_stage": pp_hidden + 8,
        "pp_messages": ranks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    print(f"| model | TP={args.ranks}: KiB/token | messages | PP={args.ranks}: KiB/token "
          "| of which logits | if the last stage sampled | messages |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, cfg in SHAPES.items():
        b = per_token(cfg, args.ranks)
        print(
            f"| {name} | {b['tp_bytes'] / 1024:,.0f} | {b['tp_messages']} | "
            f"{b['pp_bytes'] / 1024:,.0f} | {cfg.vocab_size * 4 / 1024:,.0f} | "
            f"{b['pp_bytes_sampling_on_last_stage'] / 1024:,.1f} | {b['pp_messages']} |"
        )


if __name__ == "__main__":
    main()
