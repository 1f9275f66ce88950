"""Fair admission: one request's many sequences cannot starve a small
request that came later.

Before: during `{"n": 128, "max_tokens": 8000, "ignore_eos": true}` another client's
4-token request waited behind the 64 waiting choices until it timed out, first come
first served. Now admission takes the group (API request) with the fewest running
first, and a group with nothing running takes a slot, or blocks, from the group
furthest above its fair share."""

from __future__ import annotations

import pytest
from helpers import build_hf_model

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.sequence import Status
from tokenmill.sampling import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SMALL_PROMPT = [7, 8, 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder, initializer_range=0.05, max_position_embeddings=1024)
    return folder


def _add_big(engine: LLMEngine, n: int) -> None:
    for i in range(n):  # what the server does for one API request with n choices
        engine.add_request(f"big-{i}", [3 + i, 4, 5, 6], LONG, group="big")


def _steps_until_done(engine: LLMEngine, request_id: str, limit: int) -> tuple[int, list[int]]:
    tokens: list[int] = []
    for step in range(1, limit + 1):
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.token_ids
                if out.finished:
                    return step, tokens
    raise AssertionError(f"{request_id} did not finish in {limit} steps")


def _alone(tiny) -> list[int]:
    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1)
    engine.add_request("small", SMALL_PROMPT, SHORT)
    return _steps_until_done(engine, "small", 10)[1]


def test_a_small_request_is_not_queued_behind_one_requests_many_choices(tiny):
    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_seqs=4)
    _add_big(engine, 12)  # 4 run, 8 wait
    for _ in range(3):
        engine.step()
    engine.add_request("small", SMALL_PROMPT, SHORT)
    # Slots are full and the big request holds them all: its newest choice gives one up,
    # so the small request starts at once and is done in its own 4 steps, not after 200.
    steps, tokens = _steps_until_done(engine, "small", 10)
    assert steps == 4
    assert tokens == _alone(tiny)
    engine.step()
    big = [engine.requests[f"big-{i}"].seq for i in range(12)]
    assert sum(s.status is Status.RUNNING for s in big) == 4  # the slot went back to big
    for rid in list(engine.requests):
        engine.abort(rid)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_blocks_are_shared_fairly_too(tiny):
    # 12 blocks of 16: the big request's 3 choices grow until the pool is full
    engine = LLMEngine(tiny, kv_cache_memory="192tok", threads=1, max_num_seqs=8)
    _add_big(engine, 3)
    while engine.blocks.num_free > 0:
        engine.step()
    engine.add_request("small", SMALL_PROMPT, SHORT)
    steps, tokens = _steps_until_done(engine, "small", 10)
    assert steps == 4
    assert tokens == _alone(tiny)
    assert engine.scheduler.num_preemptions >= 1
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.blocks.check_invariants([])


def test_admission_is_first_come_first_served_among_equals(tiny):
    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_seqs=2)
    for rid in ("a", "b", "c", "d"):
        engine.add_request(rid, SMALL_PROMPT, SHORT)
    engine.step()
    running = [s.request_id for s in engine.scheduler.running]
    assert running == ["a", "b"]
    while engine.has_unfinished():
        engine.step()


def test_preempted_choices_still_give_the_same_tokens(tiny):
    # the big request's choices are preempted for the small one and recomputed: greedy
    # output must not change
    def run(with_small: bool) -> dict[str, list[int]]:
        engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_seqs=2)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"big-{i}", [3 + i, 4, 5, 6], params, group="big")
        out: dict[str, list[int]] = {}
        for step in range(200):
            if with_small and step == 2:
                engine.add_request("small", SMALL_PROMPT, SHORT)
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
            if not engine.has_unfinished():
                break
        if with_small:
            assert engine.scheduler.num_preemptions >= 1
        return {k: v for k, v in out.items() if k.startswith("big")}

    assert run(True) == run(False)


def test_the_server_admits_a_small_request_beside_one_with_many_choices(tiny):
    # the attack run's shape, scaled down: n=12 x 200 tokens on 4 slots, then a 4-token
    # request from someone else; it must finish while the big one is still running
    import asyncio
    import dataclasses

    from tokenmill.server.async_engine import AsyncEngine

    server = AsyncEngine(LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_seqs=4))

    async def main() -> tuple[list[int], bool]:
        server.start()
        try:
            big = await server.generate("big", [[3, 4, 5, 6]], dataclasses.replace(LONG, n=12))
            small = await server.generate("small", [SMALL_PROMPT], SHORT)
            (generation,) = await small.collect()
            still_running = len(server.engine.requests) == 12
            big.abort()
            return generation.token_ids, still_running
        finally:
            server.stop()

    tokens, big_still_running = asyncio.run(main())
    assert tokens == _alone(tiny) and big_still_running


def test_two_traced_requests_take_turns_and_both_record_every_layer(tiny):
    """A step records one trace (the model runner hands the layers one trace's rows): two
    traced requests in one step left the second without embedding or layers.
    They take turns now, and an untraced request beside them runs every step."""
    from tokenmill.inspect.trace import Trace

    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1)
    traces = {name: Trace(layers=[0]) for name in ("a", "b")}
    for name, trace in traces.items():
        engine.add_request(name, SMALL_PROMPT, SHORT, trace=trace)
    engine.add_request("plain", SMALL_PROMPT, SHORT)
    done: dict[str, int] = {}
    for step in range(1, 30):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = step
        if len(done) == 3:
            break
    assert done["plain"] == SHORT.max_tokens  # never held back by the traces
    alone = _alone(tiny)
    for name, trace in traces.items():
        record = trace.to_dict()
        assert record["summary"]["output_ids"] == alone  # the same tokens as untraced
        assert len(record["steps"]) == SHORT.max_tokens
        for step in record["steps"]:
            assert len(step["layers"]) == engine.config.num_layers, (name, step["index"])
            assert step["embedding"]["shape"][0] == step["num_tokens"]
            assert len(step["attention"]) == 1  # the one layer asked for


def test_traced_work_is_low_priority_beside_untraced(tiny):
    """A traced step costs every row in it (on the default model, 162 ms for a traced
    64-token chunk beside one decode, against ~10 ms for the decode alone: the soak's probe
    chat waited 4.3 s beside a /v1/inspect). While untraced work runs, a trace joins one
    step in TRACE_EVERY, in chunks of at most TRACE_CHUNK; alone it runs every step, its
    prompt as one matrix. The traced tokens are the same as untraced."""
    from tokenmill.engine.scheduler import TRACE_CHUNK, TRACE_EVERY
    from tokenmill.inspect.trace import Trace

    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_batched_tokens=512)
    schedule, steps = engine.scheduler.schedule, []

    def recording():
        chunks = schedule()
        steps.append({c.seq.request_id: c.num_tokens for c in chunks})
        return chunks

    engine.scheduler.schedule = recording
    prompt = [5 + i % 90 for i in range(300)]
    engine.add_request("alone", prompt, SHORT)
    alone = _steps_until_done(engine, "alone", 10)[1]
    engine.add_request("decoding", SMALL_PROMPT, LONG)
    engine.step()
    steps.clear()
    trace = Trace(layers=[0])
    engine.add_request("traced", prompt, SHORT, trace=trace, cache_salt=1)
    _steps_until_done(engine, "traced", 60)
    assert all(s.get("decoding") == 1 for s in steps)  # the untraced one runs every step
    at = [i for i, s in enumerate(steps) if "traced" in s]
    assert all(b - a == TRACE_EVERY for a, b in zip(at, at[1:], strict=False))
    assert [steps[i]["traced"] for i in at] == [TRACE_CHUNK] * 4 + [300 - 4 * TRACE_CHUNK] + [1] * 3
    assert trace.to_dict()["summary"]["output_ids"] == alone
    engine.abort("decoding")
    steps.clear()
    engine.add_request("traced-alone", prompt, SHORT, trace=Trace(layers=[0]), cache_salt=2)
    # alone: every step, the prompt in one
    assert _steps_until_done(engine, "traced-alone", 20) == (SHORT.max_tokens, alone)


def test_prompt_work_beside_decoding_is_bounded(tiny):
    """While a sequence decodes, a step carries at most PREFILL_BESIDE_DECODE prompt
    tokens (a 512-token chunk at 2k context held every decoding client ~1 s a token);
    alone, a prompt takes the whole budget. Tokens are the same either way."""
    from tokenmill.engine.scheduler import PREFILL_BESIDE_DECODE

    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_batched_tokens=512)
    schedule, steps = engine.scheduler.schedule, []

    def recording():
        chunks = schedule()
        steps.append([(c.seq.request_id, c.num_tokens) for c in chunks])
        return chunks

    engine.scheduler.schedule = recording
    long_prompt = [5 + i % 90 for i in range(700)]
    engine.add_request("long-alone", long_prompt, SHORT)
    alone = _steps_until_done(engine, "long-alone", 10)[1]
    assert steps[0] == [("long-alone", 512)]
    steps.clear()
    engine.add_request("decoding", SMALL_PROMPT, LONG)
    engine.step()
    engine.add_request("long", long_prompt, SHORT, cache_salt=1)  # no cache hits
    assert _steps_until_done(engine, "long", 40)[1] == alone
    beside = [dict(s) for s in steps[1:]]
    assert all(s.get("decoding") == 1 for s in beside)  # it decodes every step
    prompt_steps = [s["long"] for s in beside if s.get("long", 1) > 1]
    cap = PREFILL_BESIDE_DECODE
    assert prompt_steps == [cap] * (700 // cap) + [700 % cap] * (700 % cap > 1)


def test_a_small_prompt_starts_during_a_long_one(tiny):
    """A small request that arrives while a long prompt is being prefilled is admitted
    in the next step (running prompts leave half of the prompt tokens to waiting ones),
    not after the long prompt's last chunk (the soak's probe chat waited ~5 s so)."""
    engine = LLMEngine(tiny, kv_cache_memory="2048tok", threads=1, max_num_batched_tokens=256)
    alone = _alone(tiny)
    engine.add_request("long", [5 + i % 90 for i in range(1000)], SHORT)
    engine.step()  # its first 256 tokens; 744 to go
    engine.add_request("small", SMALL_PROMPT, SHORT)
    steps, tokens = _steps_until_done(engine, "small", 10)
    assert (steps, tokens) == (SHORT.max_tokens, alone)
