"""The prefix cache on disk (engine/disk_cache.py, --prefix-cache-dir): a prompt's full KV
blocks, written while one engine runs, are read back by a new engine on the same folder
(a restart), which then computes only the rest and answers exactly as without them;
cache_salt scopes survive the restart and stay apart; a damaged or foreign block is
ignored with one warning; the folder stays within its size; and through a real server's
restart, /metrics shows the blocks read back."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from server_fixture import server_process

from tokenmill import LLM
from tokenmill.engine.block_manager import salt_root
from tokenmill.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPT = [1] + [5 + (i * 7) % 300 for i in range(100)]  # 101 tokens: 6 full blocks of 16


def engine(folder, cache_dir, **kw) -> LLM:
    return LLM(str(folder), kv_cache_memory="1024tok", threads=1, prefix_cache_dir=cache_dir, **kw)


def run(llm: LLM, prompt=PROMPT, salt: int | None = None):
    """(generated ids, prompt tokens served from cache) of one greedy request."""
    llm.engine.add_request("r", prompt, GREEDY, cache_salt=salt)
    ids, cached = [], None
    while True:
        for out in llm.engine.step():
            ids += out.token_ids
            cached = out.num_cached_tokens if cached is None else cached
            if out.finished:
                return ids, out.num_cached_tokens


def test_a_restart_reads_the_blocks_back(tiny_llama, tmp_path):
    plain = LLM(str(tiny_llama), kv_cache_memory="1024tok", threads=1)
    expected, _ = run(plain)
    plain.close()
    first = engine(tiny_llama, tmp_path)
    ids, cached = run(first)
    assert ids == expected and cached == 0
    first.engine.disk_cache.flush()
    assert first.engine.disk_cache.num_blocks == 6
    first.close()
    again = engine(tiny_llama, tmp_path)  # a new process's engine: nothing in memory
    ids, cached = run(again)
    assert ids == expected
    assert cached == 96  # the 6 full blocks; the last token is always computed
    stats = again.engine.kv_stats()
    assert stats["prefix_cache_disk_hit_tokens"] == 96
    # a prompt that shares 3 blocks, then differs: those 3 are read back, no more
    other = PROMPT[:50] + [9] * 51
    _, cached = run(again, other)
    assert cached == 48


def test_salted_scopes_survive_and_stay_apart(tiny_llama, tmp_path):
    first = engine(tiny_llama, tmp_path)
    run(first, salt=salt_root("salt-alice"))
    first.engine.disk_cache.flush()
    first.close()
    again = engine(tiny_llama, tmp_path)
    assert run(again, salt=salt_root("salt-bob"))[1] == 0
    assert run(again)[1] == 0  # the shared cache never saw it
    assert run(again, salt=salt_root("salt-alice"))[1] == 96


def test_damaged_and_foreign_blocks_are_ignored_with_one_warning(tiny_llama, tmp_path, caplog):
    first = engine(tiny_llama, tmp_path)
    expected, _ = run(first)
    first.engine.disk_cache.flush()
    folder = first.engine.disk_cache.folder
    first.close()
    # the chain's first two blocks: the first from another model (its header names another
    # key), the second cut short
    headers = {f: json.loads(f.read_bytes().split(b"\n", 1)[0]) for f in folder.glob("*.kv")}
    block0 = next(f for f, h in headers.items() if h["parent"] is None)
    name0 = int(block0.name[:16], 16)
    block1 = next(f for f, h in headers.items() if h["parent"] is not None
                  and h["parent"] & 0xFFFFFFFFFFFFFFFF == name0)  # fmt: skip
    data = block0.read_bytes()
    block0.write_bytes(re.sub(rb'"model": "[0-9a-f]+"', b'"model": "' + b"0" * 64 + b'"', data))
    block1.write_bytes(block1.read_bytes()[:1000])
    cached_runs = []
    for _ in range(3):  # each a restart: the foreign block, then the short one, then neither
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenmill.engine"):
            llm = engine(tiny_llama, tmp_path)
            ids, cached = run(llm)
            llm.engine.disk_cache.flush()
            llm.close()
        assert ids == expected
        warnings = [r for r in caplog.records if "damaged or foreign" in r.getMessage()]
        assert len(warnings) == (1 if len(cached_runs) < 2 else 0)
        cached_runs.append(cached)
    # the chain stops at the bad block, which is computed again and rewritten
    assert cached_runs == [0, 16, 96]


def test_the_folder_stays_within_its_size(tiny_llama, tmp_path):
    probe = engine(tiny_llama, tmp_path / "probe")
    run(probe)
    probe.engine.disk_cache.flush()
    block_bytes = probe.engine.disk_cache.nbytes // probe.engine.disk_cache.num_blocks
    probe.close()
    llm = engine(tiny_llama, tmp_path / "bounded", prefix_cache_disk_size=4 * block_bytes + 10)
    for start in range(5, 65, 10):  # six prompts of 6 full blocks each
        run(llm, [1] + [start + i % 7 for i in range(100)])
    llm.engine.disk_cache.flush()
    assert llm.engine.disk_cache.num_blocks <= 4
    assert sum(f.stat().st_size for f in llm.engine.disk_cache.folder.glob("*.kv")) <= (
        4 * block_bytes + 10
    )


def test_bad_settings_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="prefix_cache_disk_size"):
        engine(tiny_llama, tmp_path, prefix_cache_disk_size="lots")


@pytest.mark.slow
def test_a_restarted_server_reads_a_long_system_prompt_from_disk(smollm_path, tmp_path):
    system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(220))
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    args = ("--model", str(smollm_path), "--served-model-name", "m",
            "--prefix-cache-dir", str(tmp_path / "kv"), "--kv-cache-memory", "4096tok")  # fmt: skip
    answers = []
    for _ in range(2):  # the second server starts with nothing in memory
        with server_process(*args) as server:
            r = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=300)
            assert r.status_code == 200, r.text
            answers.append(r.json())
            metrics = httpx.get(f"{server.base_url}/metrics").text
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    assert prompt_tokens >= 2000
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    hits = re.search(r"^tokenmill_prefix_cache_disk_hit_tokens_total (\S+)", metrics, re.M)
    assert hits is not None and float(hits[1]) >= prompt_tokens - 16 - 16
    # OpenAI's usage says so too: the restarted server computed only the last partial block
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16
