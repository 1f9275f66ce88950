"""KVCache.make_resident: a server's KV pool is backed by memory from the start, so its RSS
stays flat under bursts (the soak's RSS rose by the pool's 1 GiB as bursts
reached blocks never used before), and the blocks already written keep their contents."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tokenmill.engine import kv_cache

# Runs in a process of its own: the suite's process reuses freed pages, which would hide
# (or fake) the growth being measured.
_SCRIPT = textwrap.dedent(
    """
    import torch
    from tokenmill.config import ModelConfig
    from tokenmill.engine import kv_cache

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    if {fallback}:
        kv_cache.can_populate = lambda: False
    cfg = ModelConfig(arch="llama", vocab_size=16, hidden_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=128)
    cache = kv_cache.KVCache(cfg, 16, torch.float32, torch.device("cpu"), "64MiB")
    before = rss()
    if not {fallback}:  # the written block must survive; the fallback runs before writes
        cache.k[2][:16] = 1.5
    cache.make_resident()
    grown = rss() - before
    print(grown / cache.nbytes, float(cache.k[2][:16].sum()), float(cache.v[3].abs().sum()))
    """
)


@pytest.mark.parametrize("fallback", [False, True], ids=["populate", "zero-writes"])
def test_make_resident_backs_the_pool_and_keeps_its_contents(fallback):
    if not fallback and not kv_cache.can_populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(fallback=fallback)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    share, written, untouched = map(float, out)
    assert share > 0.95  # the pool's pages are resident (a page or two at each end aside)
    assert written == (0.0 if fallback else 1.5 * 16 * 2 * 16)
    assert untouched == 0.0  # and still zeros


def test_the_engine_gives_freed_heap_back_when_it_falls_idle(monkeypatch, tmp_path):
    """After a burst, the engine idle for TRIM_AFTER_IDLE_S calls malloc_trim once (RSS
    after the soak's attacks: 1.153x where they began without it, 1.016x with it); a busy
    engine never does."""
    import asyncio
    import time

    from helpers import build_hf_model

    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.sampling import SamplingParams
    from tokenmill.server import async_engine

    build_hf_model("llama", tmp_path)
    trims: list[float] = []
    monkeypatch.setattr(async_engine, "give_back_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(async_engine, "TRIM_AFTER_IDLE_S", 0.2)
    server = async_engine.AsyncEngine(LLMEngine(tmp_path, kv_cache_memory="512tok", threads=1))

    async def main() -> float:
        server.start()
        try:
            await asyncio.sleep(0.5)
            before = len(trims)  # an idle start trims once, then waits
            stream = await server.generate("r", [[3, 4, 5]], SamplingParams(max_tokens=40))
            await stream.collect()
            done = time.monotonic()
            await asyncio.sleep(0.6)
            assert len(trims) == before + 1, trims  # once per fall into idleness
            return done
        finally:
            server.stop()

    done = asyncio.run(main())
    assert trims[-1] >= done + 0.15  # after the idle wait, not during the work
