"""Rank 0's part of a parallel run, built for the engine (engine/build.py).

    build_parallel(request) -> ModelParts
        start the other ranks (runtime.Runtime), build our part of the model, a pool of
        our heads (or layers) with as many blocks as the whole model's budget gives, and
        a runner that sends each step to the others (TPRunner, PPRunner).

The engine sits below this package and may not import it, so importing this module
registers `build_parallel` with engine/build.py (tokenmill.LLM imports it); LLMEngine
with tensor_parallel_size or pipeline_parallel_size > 1 then builds through it.
"""

from __future__ import annotations

from tokenmill.distributed import runtime as rt
from tokenmill.engine.build import ModelParts, ParallelRequest, register_parallel
from tokenmill.engine.kv_cache import KVCache, kv_blocks


def build_parallel(req: ParallelRequest) -> ModelParts:
    """Rank 0 of a parallel run; the other ranks are stopped again if loading fails."""
    if req.device.type != "cpu":
        raise ValueError("parallel runs use the CPU (gloo); use device='cpu'")
    config, tp, pp = req.ckpt.config, req.tensor_parallel_size, req.pipeline_parallel_size
    num_blocks = kv_blocks(config, req.block_size, req.dtype, req.device, req.kv_cache_memory)
    spec = rt.ParallelSpec(
        tp, pp, str(req.path), str(req.dtype).removeprefix("torch."), req.quantization,
        req.block_size, num_blocks, req.threads,
    )  # fmt: skip
    runtime = rt.Runtime(spec)
    try:
        plan = rt.describe(req.ckpt, spec)
        model, local_cfg, group = rt.build_part(req.ckpt, spec, 0, req.progress)
        # every rank loaded before the first step: a rank that dies loading is reported
        # here, with its last output, not as the first step's failure
        runtime.wait_ready()
    except BaseException:
        runtime.stop()
        raise
    cache = KVCache(local_cfg, req.block_size, req.dtype, req.device, num_blocks=num_blocks)
    if tp > 1:
        runner = rt.TPRunner(model, cache, req.device, runtime, group)
    else:
        runner = rt.PPRunner(model, cache, req.device, runtime, group, 2 * pp, config.vocab_size)
    return ModelParts(model, cache, runner, runtime, plan)


register_parallel(build_parallel)
