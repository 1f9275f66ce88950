"""The compiled-grammar cache is bounded in bytes and gives memory back.

Before: it was bounded by count only (64), and 80 distinct 20k-entry guided_choice lists
took RSS from 1.08 to 4.33 GB (64 entries of ~50 MiB) and never released it."""

from __future__ import annotations

import pytest

from tokenmill.engine.llm_engine import load_tokenizer
from tokenmill.sampling import grammar as g


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return load_tokenizer(smollm_path)


def _choices(j: int, n: int = 4000) -> list[str]:
    return [f"option {j} {i} word{i * 7}" for i in range(n)]


def test_the_cache_holds_at_most_its_byte_budget(tokenizer):
    budget = 16 * 2**20
    compiler = g.GrammarCompiler(tokenizer, 49152, [2], cache_bytes=budget)
    compiler.lltokenizer()
    sizes = []
    for j in range(8):
        compiled = compiler.compile("choice", _choices(j))
        sizes.append(compiled.nbytes)
        assert compiler.cached_bytes <= budget
        assert compiled.nbytes >= g.BYTES_PER_SOURCE_CHAR * sum(map(len, _choices(j)))
    assert len(compiler._cache) < 8  # the oldest went
    assert compiler.cached_bytes == sum(c.nbytes for c, _ in compiler._cache.values())
    # the newest is still cached: the same constraint again is the same object
    assert compiler.compile("choice", _choices(7)) is compiled
    # one larger than the whole budget is compiled and used, but not kept
    tiny = g.GrammarCompiler(tokenizer, 49152, [2], cache_bytes=1024)
    big = tiny.compile("choice", _choices(0, 500))
    assert big.matcher() is not None and tiny.cached_bytes == 0 and not tiny._cache


_BURST = """
import gc, sys, time
from pathlib import Path
from tokenmill.engine.llm_engine import load_tokenizer
from tokenmill.sampling import grammar as g

compiler = g.GrammarCompiler(load_tokenizer(Path(sys.argv[1])), 49152, [2], cache_bytes=2**30)
compiler.compile("choice", ["a", "b"])  # llguidance's own one-time state
gc.collect()
g.give_back_memory()
idle = g._rss_bytes()
for j in range(4):  # a burst of large distinct constraints
    compiler.compile("choice", [f"option {j} {i} word{i * 7}" for i in range(20_000)])
peak = g._rss_bytes()
assert len(compiler._cache) == 5, len(compiler._cache)
compiler.cache_idle_s = 0.05  # as if the server had been quiet for 10 minutes
time.sleep(0.1)
compiler.compile("regex", "[ab]")  # the next compile sweeps the idle ones
assert [k[0] for k in compiler._cache] == ["regex"], list(compiler._cache)
gc.collect()
print(idle, peak, g._rss_bytes())
"""


def test_idle_entries_are_dropped_and_memory_returns(smollm_path):
    # In a process of its own: the suite's process reuses pages that earlier tests freed,
    # so its RSS would say little about what the burst took and gave back.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _BURST, str(smollm_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    idle, peak, after = map(int, done.stdout.split())
    assert peak - idle > 50 * 2**20  # the burst really cost memory (~25-45 MiB each)
    # back near the idle level (within 10% of what the burst took, plus 16 MiB of slack
    # for the allocator's own bookkeeping)
    assert after - idle < 0.1 * (peak - idle) + 16 * 2**20, (idle, peak, after)
