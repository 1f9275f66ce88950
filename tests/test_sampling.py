"""Sampler tests: distributions by chi-square, filters by their definitions,
penalties on hand-computed examples, seeds, logprobs and parameter validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling import (
    Sampler,
    SamplingParams,
    SamplingState,
    apply_logit_bias,
    apply_penalties,
    min_p_mask,
    process_logits,
    top_k_mask,
    top_p_mask,
)

# A fixed row with well-separated logits, so no reference filter sits on a rounding boundary.
LOGITS = torch.tensor([2.0, 1.5, 1.1, 0.7, 0.4, 0.0, -0.3, -0.8, -1.2, -2.0, 1.3, 0.2])
VOCAB = LOGITS.numel()
DRAWS = 20_000


def state(params: SamplingParams, prompt: list[int] | None = None, **kw) -> SamplingState:
    return SamplingState.create(params, prompt or [], vocab_size=kw.pop("vocab_size", VOCAB), **kw)


def reference_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """Independent float64 implementation of the filter definitions."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones(x.size, dtype=bool)
    order = np.argsort(-x, kind="stable")
    if top_k:
        keep[order[top_k:]] = False

    def probs() -> np.ndarray:
        e = np.where(keep, np.exp(x - x.max()), 0.0)
        return e / e.sum()

    if top_p < 1.0:
        mass = np.cumsum(probs()[order])
        assert np.abs(mass - top_p).min() > 1e-3, "test design: top_p too close to a boundary"
        # Smallest prefix of the ranking with mass >= top_p.
        size = int(np.searchsorted(mass, top_p)) + 1
        keep[order[size:]] = False
    if min_p > 0.0:
        p = probs()
        assert np.abs(p - min_p * p.max()).min() > 1e-3, "test design: min_p on a boundary"
        keep &= p >= min_p * p.max()
    return probs()


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty; z = 3.09 is alpha = 1e-3."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches(counts: np.ndarray, expected_probs: np.ndarray) -> None:
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"drew filtered tokens: {counts}"
    expected = expected_probs[support] * counts.sum()
    assert expected.min() >= 5, "test design: chi-square needs >= 5 expected per cell"
    if support.sum() == 1:
        return
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    assert stat < chi_square_critical(int(support.sum()) - 1), (stat, counts, expected)


CONFIGS = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.55),
    "min_p": dict(temperature=1.0, min_p=0.25),
    "combined": dict(temperature=1.3, top_k=8, top_p=0.8, min_p=0.1),
}


def draw(params_kw: dict, seeded: bool) -> np.ndarray:
    torch.manual_seed(1234)
    states = [
        state(SamplingParams(**params_kw, seed=1000 + i if seeded else None)) for i in range(DRAWS)
    ]
    out = Sampler()(LOGITS.expand(DRAWS, VOCAB).contiguous(), states)
    return np.bincount(out.token_ids, minlength=VOCAB)


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "per-row-seed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_empirical_distribution_matches_filtered_distribution(name: str, seeded: bool) -> None:
    kw = CONFIGS[name]
    expected = reference_probs(
        LOGITS.numpy(),
        kw["temperature"],
        kw.get("top_k", 0),
        kw.get("top_p", 1.0),
        kw.get("min_p", 0.0),
    )
    if len(kw) > 1:
        assert (expected == 0).any(), "test design: the filter should drop something"
    assert_matches(draw(kw, seeded), expected)


def test_chi_square_check_rejects_the_wrong_distribution() -> None:
    # Negative control: the test has power against a mildly distorted distribution.
    counts = draw(CONFIGS["temperature"], seeded=False)
    wrong = reference_probs(LOGITS.numpy(), 0.7, 0, 1.0, 0.0) ** 1.1
    with pytest.raises(AssertionError):
        assert_matches(counts, wrong / wrong.sum())


def test_process_logits_final_distribution_is_the_reference() -> None:
    kw = CONFIGS["combined"]
    trace = process_logits(LOGITS, state(SamplingParams(**kw)))
    expected = reference_probs(LOGITS.numpy(), kw["temperature"], 8, 0.8, 0.1)
    np.testing.assert_allclose(trace.final_probs.numpy(), expected, atol=1e-6)
    np.testing.assert_array_equal(trace.keep.numpy(), expected > 0)
    assert trace.keep_top_k.sum() == 8
    assert bool((trace.keep_top_p <= trace.keep_top_k).all())
    np.testing.assert_allclose(trace.probs.numpy(), LOGITS.softmax(-1).numpy(), atol=1e-7)
    np.testing.assert_allclose(
        trace.scaled_probs.numpy(), (LOGITS / 1.3).softmax(-1).numpy(), atol=1e-7
    )


# --------------------------------------------------------------------------- filter definitions

logit_rows = st.lists(st.floats(-8.0, 8.0, allow_nan=False, width=32), min_size=1, max_size=40).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32)
)
tied_rows = st.lists(st.integers(-3, 3), min_size=1, max_size=40).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32)
)


@settings(max_examples=200, deadline=None)
@given(logits=logit_rows, p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(logits: torch.Tensor, p: float) -> None:
    keep = top_p_mask(logits[None], torch.tensor([p]))[0]
    probs = logits.softmax(-1).double()
    kept, dropped = probs[keep], probs[~keep]
    assert keep.any()
    if dropped.numel():
        assert kept.min() >= dropped.max()  # the most probable tokens
        assert kept.sum() >= p - 1e-6  # mass reaches p ...
    assert kept.sum() - kept.min() < p + 1e-6  # ... and no smaller set would
    if p == 1.0:
        assert keep.all()


@pytest.mark.parametrize(
    ("p", "kept"), [(0.25, 1), (0.5, 2), (0.5000001, 3), (0.75, 3), (0.76, 4), (1.0, 4)]
)
def test_top_p_boundary_is_exact(p: float, kept: int) -> None:
    # Four equal logits: every probability and partial sum is exact in float32.
    keep = top_p_mask(torch.zeros(1, 4), torch.tensor([p]))[0]
    assert keep.tolist() == [True] * kept + [False] * (4 - kept)


def test_top_p_mass_is_measured_after_top_k() -> None:
    # Filters are sequential: after top-k=2 the survivors are 50/50, so top-p=0.5 keeps one.
    logits = torch.tensor([1.0, 1.0, 0.9, 0.9, 0.9, 0.9])
    trace = process_logits(logits, state(SamplingParams(top_k=2, top_p=0.5), vocab_size=6))
    assert trace.keep.tolist() == [True] + [False] * 5


@settings(max_examples=200, deadline=None)
@given(logits=st.one_of(logit_rows, tied_rows), k=st.integers(0, 45))
def test_top_k_keeps_exactly_k_highest(logits: torch.Tensor, k: int) -> None:
    keep = top_k_mask(logits[None], torch.tensor([k]))[0]
    v = logits.numel()
    assert int(keep.sum()) == (min(k, v) if k else v)
    if not keep.all():
        assert logits[keep].min() >= logits[~keep].max()
        # Ties at the boundary go to the lower token id.
        boundary = logits[keep].min()
        tied = (logits == boundary).nonzero()[:, 0]
        kept_tied = keep[tied]
        assert bool((kept_tied[:-1].int() >= kept_tied[1:].int()).all())


@settings(max_examples=200, deadline=None)
@given(logits=logit_rows, min_p=st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_above_fraction_of_max(logits: torch.Tensor, min_p: float) -> None:
    keep = min_p_mask(logits[None], torch.tensor([min_p]))[0]
    probs = logits.softmax(-1).double()
    threshold = min_p * probs.max()
    assert keep[probs.argmax()]
    assert bool((probs[keep] >= threshold * (1 - 1e-5)).all())
    assert bool((probs[~keep] < threshold * (1 + 1e-5)).all())


def stable_sort_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Oracle: rank by a stable descending sort and keep the first k."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    k = torch.where(k > 0, k, logits.shape[-1])
    keep_sorted = torch.arange(logits.shape[-1])[None, :] < k[:, None]
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def stable_sort_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Oracle: stable descending sort by probability; keep while the mass before < p."""
    sorted_probs, order = torch.sort(logits.softmax(-1), dim=-1, descending=True, stable=True)
    mass_before = torch.cat([torch.zeros_like(p)[:, None], sorted_probs.cumsum(-1)[:, :-1]], -1)
    keep_sorted = (mass_before < p[:, None]) | (p[:, None] >= 1.0)
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


@st.composite
def logit_batches(draw) -> torch.Tensor:
    """[B, V] logits, some wide enough to make top_p_mask widen, many with ties."""
    rows = draw(st.integers(1, 4))
    vocab = draw(st.sampled_from([1, 2, 7, 300, 3000]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab, generator=gen) * draw(st.sampled_from([0.05, 1.0, 6.0]))
    rounding = draw(st.sampled_from(["none", "bf16", "coarse"]))
    if rounding == "bf16":
        logits = logits.bfloat16().float()
    elif rounding == "coarse":
        logits = (logits * 2).round() / 2
    return logits


@settings(max_examples=150, deadline=None)
@given(logits=logit_batches(), data=st.data())
def test_top_k_and_top_p_equal_stable_sort_oracle(logits: torch.Tensor, data) -> None:
    rows, vocab = logits.shape
    k = torch.tensor(data.draw(st.lists(st.integers(0, vocab + 2), min_size=rows, max_size=rows)))
    torch.testing.assert_close(top_k_mask(logits, k), stable_sort_top_k(logits, k), rtol=0, atol=0)
    p = torch.tensor(data.draw(st.lists(st.floats(0.01, 1.0), min_size=rows, max_size=rows)))
    torch.testing.assert_close(top_p_mask(logits, p), stable_sort_top_p(logits, p), rtol=0, atol=0)


# --------------------------------------------------------------------------- penalties and bias


def test_apply_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, True, False, False]])
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0]])
    out = apply_penalties(
        logits, seen, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    # repetition: 2/2, -2*2, 1/2 ; frequency: -0.25*count ; presence: -0.5 if count > 0
    expected = torch.tensor([[1.0, -4.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, 0.5, 3.0]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(logits, torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]]))  # not mutated


def test_state_tracks_prompt_and_output_for_penalties() -> None:
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    s = state(params, prompt=[0], vocab_size=5)
    for t in (1, 1, 2):
        s.append(t)
    trace = process_logits(torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0]), s)
    # Token 0 is prompt-only: repetition applies, presence/frequency (output-only) do not.
    torch.testing.assert_close(trace.logits, torch.tensor([1.0, -5.0, -0.25, 0.5, 3.0]))
    assert s.output_counts.tolist() == [0.0, 2.0, 1.0, 0.0, 0.0]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    s = state(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1], vocab_size=3)
    assert Sampler()(logits, [s]).token_ids == [2]  # [1, 3/2, 2]
    s.append(2)
    assert Sampler()(logits, [s]).token_ids == [1]  # [1, 3/2, 2/2]


def test_presence_and_frequency_only_count_output() -> None:
    logits = torch.tensor([[1.0, 1.2]])
    s = state(SamplingParams(temperature=0, frequency_penalty=0.3), prompt=[1, 1, 1], vocab_size=2)
    assert Sampler()(logits, [s]).token_ids == [1]
    s.append(1)
    assert Sampler()(logits, [s]).token_ids == [0]  # 1.2 - 0.3 < 1.0


def test_logit_bias_bans_and_forces() -> None:
    logits = torch.tensor([[5.0, 0.0, -3.0, 1.0]])
    banned = state(SamplingParams(temperature=0, logit_bias={0: -100}), vocab_size=4)
    assert Sampler()(logits, [banned]).token_ids == [3]
    torch.manual_seed(0)
    forced = [state(SamplingParams(logit_bias={"2": 100}), vocab_size=4) for _ in range(500)]
    assert set(Sampler()(logits.expand(500, 4), forced).token_ids) == {2}


def test_logit_bias_keys_are_ascii_digits() -> None:
    """str.isdecimal() and int() also read other scripts' digits: "١٢" must not be token 12."""
    for key in ("\u0661\u0662", "\uff11\uff12", "1\u0662", "+12", " 12"):
        with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
            SamplingParams(logit_bias={key: 1.0})
    assert SamplingParams(logit_bias={"12": 1.0}).logit_bias == {12: 1.0}


def test_apply_logit_bias_is_sparse_per_row() -> None:
    logits = torch.zeros(2, 3)
    out = apply_logit_bias(
        logits, torch.tensor([1, 1]), torch.tensor([0, 2]), torch.tensor([1.5, -2.0])
    )
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [1.5, 0.0, -2.0]]))
    assert logits.abs().sum() == 0


def test_logit_bias_id_checked_against_vocab() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        state(SamplingParams(logit_bias={12: 1.0}))


# --------------------------------------------------------------------------- greedy


def test_greedy_fast_path_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    states = [state(SamplingParams(temperature=0), vocab_size=50) for _ in range(6)]
    assert Sampler()(logits, states).token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_random_rows() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    states = [
        state(SamplingParams(temperature=0), vocab_size=50),
        state(SamplingParams(temperature=1.0, seed=3), vocab_size=50),
        state(SamplingParams(top_k=1, temperature=2.0), vocab_size=50),
        state(SamplingParams(temperature=0, logit_bias={7: 100}), vocab_size=50),
    ]
    out = Sampler()(logits, states).token_ids
    assert out[0] == int(logits[0].argmax())
    assert out[2] == int(logits[2].argmax())
    assert out[3] == 7
    trace = process_logits(logits[3], states[3])
    assert int(trace.final_probs.argmax()) == 7 and trace.final_probs.sum() == 1


# --------------------------------------------------------------------------- seeds


def run_steps(
    states: list[SamplingState], row_logits: torch.Tensor, steps: int = 20
) -> list[list[int]]:
    """Sample `steps` tokens for every state; row i always sees row_logits[i]."""
    sampler = Sampler()
    tokens: list[list[int]] = [[] for _ in states]
    for _ in range(steps):
        out = sampler(row_logits, states)
        for s, t, seen in zip(states, out.token_ids, tokens, strict=True):
            s.append(t)
            seen.append(t)
    return tokens


FLAT = torch.zeros(1, 64)  # uniform: every draw is informative


def seeded(seed: int | None, **kw) -> SamplingState:
    return state(SamplingParams(seed=seed, **kw), vocab_size=64)


def test_same_seed_same_tokens() -> None:
    assert run_steps([seeded(7)], FLAT) == run_steps([seeded(7)], FLAT)


def test_different_seeds_differ() -> None:
    assert run_steps([seeded(7)], FLAT) != run_steps([seeded(8)], FLAT)


def test_seeded_row_independent_of_batch_composition() -> None:
    def subject() -> SamplingState:
        return seeded(42, top_p=0.9, repetition_penalty=1.2)

    row = torch.randn(64, generator=torch.Generator().manual_seed(4))
    alone = run_steps([subject()], row[None])[0]
    batch = [
        seeded(None),
        subject(),
        seeded(5, top_k=3),
        seeded(None, temperature=0),
        seeded(9, min_p=0.5, logprobs=3),
    ]
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    logits[1] = row  # the subject sees the same row as when alone
    assert run_steps(batch, logits)[1] == alone


def test_n_completions_of_a_seeded_request_differ_but_reproduce() -> None:
    def completion(i: int) -> list[int]:
        s = state(SamplingParams(seed=7), vocab_size=64, completion_index=i)
        return run_steps([s], FLAT)[0]

    assert completion(0) == run_steps([seeded(7)], FLAT)[0]
    assert completion(1) != completion(0)
    assert completion(1) == completion(1)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    states = [
        state(
            SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.5, logprobs=4),
            [1, 2],
            vocab_size=30,
        ),
        state(SamplingParams(temperature=0), vocab_size=30),
        state(SamplingParams(temperature=0, logprobs=0), vocab_size=30),
    ]
    out = Sampler()(logits, states)
    ref = logits.log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(float(ref[0, out.token_ids[0]]), abs=1e-6)
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 4
    values = list(top.values())
    assert values == sorted(values, reverse=True)
    expected_ids = ref[0].topk(4).indices.tolist()
    assert list(top) == expected_ids
    for tok, lp in top.items():
        assert lp == pytest.approx(float(ref[0, tok]), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.logprobs[2] == pytest.approx(float(ref[2].max()), abs=1e-6)
    assert out.top_logprobs[2] == {}


# --------------------------------------------------------------------------- validation

BAD_PARAMS = [
    ("max_tokens", 0),
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("temperature", -1),
    ("temperature", "1.0"),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", 1e-46),  # > 0 in float64, 0 in the sampler's float32
    ("temperature", 1e39),  # inf in float32
    ("repetition_penalty", 1e-46),
    ("presence_penalty", -1e39),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3),
    ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 0}),
    ("logit_bias", {"a": 1}),
    ("logit_bias", [1, 2]),
    ("seed", "x"),
    ("seed", 2**64),
    ("stop", ""),
    ("stop", ["a", ""]),
    ("stop", [1]),
    ("stop", [f"s{i}" for i in range(65)]),  # 12,000 of them slowed every client
    ("stop", ["x" * 1001]),
    ("stop_token_ids", list(range(1025))),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", 5),
    ("ignore_eos", "yes"),
    ("logprobs", 21),
    ("logprobs", -1),
    ("n", 0),
    ("n", True),
]


@pytest.mark.parametrize(("name", "value"), BAD_PARAMS, ids=[f"{n}={v!r}" for n, v in BAD_PARAMS])
def test_bad_params_raise_naming_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    assert "\n" not in str(info.value)


def test_a_top_k_past_int64_is_off() -> None:
    """top_k 2**63 (int64 overflow in the sampler's tensor, which failed every request in
    the step) keeps every token, as any k past the vocabulary does."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(4))
    huge = [state(SamplingParams(top_k=2**63, seed=9), vocab_size=50) for _ in range(2)]
    off = [state(SamplingParams(top_k=0, seed=9), vocab_size=50) for _ in range(2)]
    assert run_steps(huge, logits, 10) == run_steps(off, logits, 10)
    mixed = [
        state(SamplingParams(top_k=2**63), vocab_size=50),
        state(SamplingParams(top_k=3), vocab_size=50),
    ]
    assert len(Sampler()(logits, mixed).token_ids) == 2


def test_floats_are_kept_as_their_float32() -> None:
    assert SamplingParams(temperature=1e-46).greedy  # 0 in float32
    assert SamplingParams(min_p=1e-46).min_p == 0.0
    assert SamplingParams(top_p=0.1).top_p == float(torch.tensor(0.1).item())


def test_params_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=1, logit_bias={"5": -1})
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []
    assert isinstance(p.temperature, float) and p.logit_bias == {5: -1.0}
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(temperature=1e-30).greedy  # would overflow logits / temperature
    assert not SamplingParams().greedy
