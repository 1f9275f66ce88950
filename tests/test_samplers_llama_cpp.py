"""Typical-p and top-n-sigma (sampling/sampler.py) keep the tokens llama.cpp's own samplers
keep (llama-cpp-python's llama_sampler_init_typical / _top_n_sigma applied to the same
logits), up to its float32 sums, and typical-p's exact (float64) set; on random rows of a
real vocabulary's width; and through SamplingParams, the Sampler, the CLI and the OpenAI
body."""

from __future__ import annotations

import ctypes
import importlib.util

import numpy as np
import pytest
import torch

from tokenmill.sampling.params import ParamError, SamplingParams
from tokenmill.sampling.sampler import (
    Sampler,
    SamplingState,
    _move_mu,
    mirostat_mask,
    top_n_sigma_mask,
    typical_mask,
    xtc_mask,
)

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


def llama_cpp_apply(logits: np.ndarray, sampler) -> dict[int, float]:
    """A llama.cpp sampler applied to an array of `logits` [V]: the token ids it leaves,
    each with its logit after it (the sampler is freed)."""
    import llama_cpp

    v = logits.shape[0]
    data = (llama_cpp.llama_token_data * v)()
    for i, x in enumerate(logits.tolist()):
        data[i].id, data[i].logit, data[i].p = i, x, 0.0
    arr = llama_cpp.llama_token_data_array(data=data, size=v, selected=-1, sorted=False)
    try:
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
    finally:
        llama_cpp.llama_sampler_free(sampler)
    kept = arr.data  # a sampler may move the array's start (XTC drops its head)
    return {kept[i].id: kept[i].logit for i in range(arr.size)}


def llama_cpp_keeps(logits: np.ndarray, sampler) -> set[int]:
    """The token ids a llama.cpp sampler leaves with a finite logit in `logits` [V]."""
    return {i for i, x in llama_cpp_apply(logits, sampler).items() if np.isfinite(x)}


def rows(seed: int, n: int = 6, vocab: int = 49152) -> np.ndarray:
    """Logit rows as a model's look: a few strong tokens over a broad normal mass."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, vocab)).astype(np.float32) * np.float32(2.0)
    x[:, rng.integers(0, vocab, 20)] += np.float32(8.0)
    return x


@needs_llama_cpp
@pytest.mark.parametrize("p", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_keeps_what_llama_cpp_keeps(p):
    import llama_cpp

    x = rows(1)
    keep = typical_mask(torch.from_numpy(x), torch.full((x.shape[0],), p))
    for i, row in enumerate(x):
        theirs = llama_cpp_keeps(row, llama_cpp.llama_sampler_init_typical(p, 1))
        ours = set(torch.nonzero(keep[i]).flatten().tolist())
        # The definition in float64: rank by |-log p - H|, keep while the mass before < p
        logp = row.astype(np.float64) - np.logaddexp.reduce(row.astype(np.float64))
        prob = np.exp(logp)
        order = np.argsort(np.abs(-logp - (-(prob * logp).sum())), kind="stable")
        exact = set(order[np.cumsum(prob[order]) - prob[order] <= p].tolist())
        assert len(ours ^ exact) <= 2, len(ours ^ exact)
        # llama.cpp computes the same in float32, summing 49,152 masses one by one: near
        # the cut, where thousands of tokens lie at nearly one distance from H, its
        # ranking and sums part from the exact ones by a few tokens in ten thousand
        assert len(ours ^ theirs) <= max(2, len(theirs) // 1000), (len(ours), len(theirs))


@needs_llama_cpp
@pytest.mark.parametrize("n", [0.5, 1.0, 2.0, 3.5])
def test_top_n_sigma_keeps_what_llama_cpp_keeps(n):
    import llama_cpp

    x = rows(2)
    x[0, :100] = -np.inf  # tokens already dropped (a grammar's) leave the statistics
    keep = top_n_sigma_mask(torch.from_numpy(x), torch.full((x.shape[0],), n))
    for i, row in enumerate(x):
        theirs = llama_cpp_keeps(row, llama_cpp.llama_sampler_init_top_n_sigma(n))
        parted = set(torch.nonzero(keep[i]).flatten().tolist()) ^ theirs
        # llama.cpp sums 49,152 float32 logits one by one for the mean and deviation, torch
        # in blocks: the threshold moves by ~1e-5, so only a token that close may part
        finite = row[np.isfinite(row)].astype(np.float64)
        cut = finite.max() - n * finite.std()
        assert all(abs(row[t] - cut) < 1e-3 for t in parted), (parted, cut)


def test_off_values_keep_everything_and_bad_values_are_named():
    x = torch.from_numpy(rows(3, n=2, vocab=64))
    assert typical_mask(x, torch.tensor([1.0, 1.0])).all()
    assert top_n_sigma_mask(x, torch.tensor([0.0, 0.0])).all()
    mixed = top_n_sigma_mask(x, torch.tensor([0.0, 1.0]))
    assert mixed[0].all() and not mixed[1].all()
    with pytest.raises(ParamError, match="typical_p"):
        SamplingParams(typical_p=0.0)
    with pytest.raises(ParamError, match="top_n_sigma"):
        SamplingParams(top_n_sigma=-1.0)


def test_the_sampler_draws_only_survivors():
    """Seeded draws through the whole Sampler stay inside each filter's survivors."""
    x = torch.from_numpy(rows(4, n=2, vocab=512))
    for params, mask in (
        (SamplingParams(temperature=0.8, typical_p=0.3, seed=1), typical_mask),
        (SamplingParams(temperature=1.5, top_n_sigma=1.0, seed=2), top_n_sigma_mask),
    ):
        states = [SamplingState.create(params, [1], vocab_size=512) for _ in range(2)]
        value = params.typical_p if mask is typical_mask else params.top_n_sigma
        scaled = x / params.temperature
        keep = mask(scaled, torch.full((2,), value))
        for _ in range(30):
            out = Sampler()(x, states).token_ids
            assert all(bool(keep[i, t]) for i, t in enumerate(out))


def test_cli_and_openai_body_carry_them():
    from tokenmill.cli import build_parser
    from tokenmill.cli.common import _params
    from tokenmill.server.protocol import ChatCompletionRequest

    args = build_parser().parse_args(
        ["generate", "hi", "--typical-p", "0.7", "--top-n-sigma", "1.5", "--xtc-probability",
         "0.5", "--xtc-threshold", "0.2", "--mirostat", "2", "--mirostat-tau", "4"]
    )  # fmt: skip
    params = _params(args)
    assert (params.typical_p, params.top_n_sigma) == (pytest.approx(0.7), 1.5)
    assert (params.xtc_probability, params.xtc_threshold) == (0.5, pytest.approx(0.2))
    assert (params.mirostat, params.mirostat_tau, params.mirostat_eta) == (
        2,
        4.0,
        pytest.approx(0.1),
    )
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "typical_p": 0.5, "top_n_sigma": 2,
         "xtc_probability": 0.3, "mirostat": 2, "mirostat_tau": 3.5}
    )  # fmt: skip
    fields = body._sampling_kwargs()
    assert (fields["typical_p"], fields["top_n_sigma"]) == (0.5, 2)
    assert (fields["xtc_probability"], fields["mirostat"], fields["mirostat_tau"]) == (0.3, 2, 3.5)


@needs_llama_cpp
@pytest.mark.parametrize("threshold", [0.01, 0.05, 0.1, 0.3])
def test_xtc_drops_what_llama_cpp_drops(threshold):
    """XTC with probability 1 (its coin always fires): the same survivors as llama.cpp's."""
    import llama_cpp

    x = rows(5)
    x[:, :3] += np.float32(6.0)  # a few tokens above every threshold
    n = x.shape[0]
    keep = xtc_mask(
        torch.from_numpy(x), torch.full((n,), threshold), torch.ones(n, dtype=torch.bool)
    )
    for i, row in enumerate(x):
        theirs = llama_cpp_keeps(row, llama_cpp.llama_sampler_init_xtc(1.0, threshold, 1, 0))
        assert set(torch.nonzero(keep[i]).flatten().tolist()) == theirs
    assert xtc_mask(
        torch.from_numpy(x), torch.full((n,), threshold), torch.zeros(n, dtype=torch.bool)
    ).all()


@needs_llama_cpp
def test_mirostat_v2_cuts_and_moves_mu_as_llama_cpp_does():
    """Each step: the tokens llama.cpp's mirostat_v2 keeps (the array it leaves) are the
    ones mirostat_mask keeps at our mu, and after its draw (its `selected`) our update
    of mu gives the next step's cut too: five steps on one row, tau 3, eta 0.5."""
    import llama_cpp

    tau, eta = 3.0, 0.5
    x = rows(6, n=5, vocab=4096)
    sampler = llama_cpp.llama_sampler_init_mirostat_v2(7, tau, eta)
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=tau, mirostat_eta=eta)
    state = SamplingState.create(params, [1], vocab_size=4096)
    assert state.mu == 2 * tau
    try:
        for row in x:
            data = (llama_cpp.llama_token_data * row.shape[0])()
            for i, v in enumerate(row.tolist()):
                data[i].id, data[i].logit, data[i].p = i, v, 0.0
            arr = llama_cpp.llama_token_data_array(
                data=data, size=row.shape[0], selected=-1, sorted=False
            )
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
            theirs = {arr.data[i].id for i in range(arr.size)}
            drawn = arr.data[arr.selected].id
            logits = torch.from_numpy(row)[None]
            keep = mirostat_mask(logits, torch.tensor([state.mu]))
            # llama.cpp's log2f of float32 probabilities against ours of float32 logs: a
            # token whose surprise is within 1e-4 bits of mu may part
            surprise = -(logits[0].double().log_softmax(-1)) / np.log(2)
            parted = set(torch.nonzero(keep[0]).flatten().tolist()) ^ theirs
            assert all(abs(float(surprise[t]) - state.mu) < 1e-4 for t in parted), parted
            probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
            _move_mu([state], probs, torch.tensor([drawn]))
    finally:
        llama_cpp.llama_sampler_free(sampler)
    assert state.mu != 2 * tau


def test_xtc_and_mirostat_in_the_sampler():
    """Through the Sampler: an XTC row never draws a top choice once its coin fires (at
    probability 1), a mirostat row moves its mu each step; a greedy row takes neither."""
    x = torch.from_numpy(rows(7, n=1, vocab=256)).repeat(3, 1)
    x[:, :2] += 10.0  # two tokens above any threshold
    xtc = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1, seed=3)
    miro = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=2.0, seed=4)
    states = [
        SamplingState.create(p, [1], vocab_size=256)
        for p in (xtc, miro, SamplingParams(temperature=0))
    ]
    mus = []
    for _ in range(20):
        out = Sampler()(x, states).token_ids
        assert out[0] != int(x[0].argmax())  # two or more above 0.1: the top one goes
        mus.append(states[1].mu)
        assert out[2] == int(x[2].argmax())
    assert len(set(mus)) > 1
    with pytest.raises(ParamError, match="mirostat"):
        SamplingParams(mirostat=1)
    with pytest.raises(ParamError, match="xtc_probability"):
        SamplingParams(xtc_probability=1.5)
