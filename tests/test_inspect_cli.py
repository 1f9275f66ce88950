"""`tokenmill inspect` as a pipe sees it: shades instead of colour only, whole tables at any
width, speeds that are never a misleading 0, and the same trace on every run by default.

A tiny random-weight llama (built with transformers) keeps these in the fast subset.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.inspect.view import ID_MARK, SHADES, shade, visible

PROMPT = "t5 t6 t7 t8 t9 t10"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from helpers import build_hf_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    build_hf_model("llama", folder)
    return folder


def inspect(
    tiny: Path, tmp: Path, *args: str, columns: str | None = None, prompt: str = PROMPT
) -> tuple[str, dict]:
    """Run the command with stdout a pipe; returns what it printed and its --json trace."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "NO_COLOR")}
    if columns:
        env["COLUMNS"] = columns
    trace = tmp / f"trace-{len(list(tmp.iterdir()))}.json"
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "inspect", prompt, "--model", str(tiny),
         "--max-tokens", "3", "--kv-cache-memory", "8MiB", "--json", str(trace), *args],
        stdin=subprocess.DEVNULL,  # no terminal anywhere: the width cannot come from one
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout  # a pipe gets plain text
    return r.stdout, json.loads(trace.read_text())


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory) -> tuple[str, dict]:
    return inspect(tiny, tmp_path_factory.mktemp("plain"))


def _section(text: str, start: str, end: str) -> list[str]:
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i, line in enumerate(lines) if line.startswith(end) and i > first)
    return lines[first + 1 : last]


def test_token_ids_are_set_apart_from_their_tokens(plain):
    """Plain output has no chip colours, so `The504` would read as one token: each token is
    followed by ·id, and a space comes before the next token."""
    text, trace = plain
    (chips,) = _section(text, "1. Tokenize", "pieces: ")
    step = trace["steps"][0]
    texts = trace["prompt"]["texts"][: step["num_tokens"]]
    assert len(texts) == len(step["input_ids"]) > 1
    expected = [f"{visible(t)}{ID_MARK}{i}" for t, i in zip(texts, step["input_ids"], strict=True)]
    assert chips.split() == expected
    assert all(re.fullmatch(rf"\S+{ID_MARK}\d+", chip) for chip in chips.split())


def test_heatmap_is_drawn_in_shades_a_pipe_keeps(plain):
    text, trace = plain
    (att,) = trace["steps"][0]["attention"]
    # each row: the token, its position, then two characters per key
    rows = [
        m for line in _section(text, "6. Masked", "   weight 0")
        if (m := re.match(r"^\s*(\S+)\s+(\d+) (.*)$", line))
    ]  # fmt: skip
    assert [int(m[2]) for m in rows] == att["query_positions"]
    for m, row in zip(rows, att["weights"][0], strict=True):
        q = int(m[2])
        cells = "".join(shade(w) * 2 for w in row[: q + 1]) + " ·" * (att["context"] - q - 1)
        assert m[3].rstrip() == cells.rstrip()
    assert any(c in m[3] for m in rows for c in SHADES[1:])  # not all blank
    assert f"shades '{SHADES}'" in text


def test_per_head_cells_are_shaded(plain):
    text, trace = plain
    table = _section(text, " layer", "8. Un-embed")
    layers = trace["steps"][0]["layers"]
    assert len(table) == len(layers)
    for line, layer in zip(table, layers, strict=True):
        assert "".join(shade(v) * 2 for v in layer["max"]) in line


def test_speeds_have_significant_digits(plain):
    text, _ = plain
    speeds = re.findall(r"([\d.,]+) tok/s", text)
    assert len(speeds) >= 3  # prefill, each decode step, the summary
    for speed in speeds:
        assert float(speed.replace(",", "")) > 0, speed  # never "0 tok/s"
        assert len(speed.replace(",", "").replace(".", "").lstrip("0")) >= 3 or "," in speed


def test_default_seed_shows_the_same_trace_twice(plain, tiny, tmp_path):
    text, trace = plain
    assert "seed 0, the default: a rerun draws the same tokens" in text
    again, second = inspect(tiny, tmp_path, columns="150")
    tokens = [[s["sample"]["token"] for s in t["steps"]] for t in (trace, second)]
    assert tokens[0] == tokens[1]
    # the rule lines take the width from $COLUMNS
    assert any(len(line) == 150 and "Timing" in line for line in again.splitlines())
    # and another seed draws differently (the tiny model's distributions are flat)
    _, other = inspect(tiny, tmp_path, "--seed", "1", "--width", "40")
    assert [s["sample"]["token"] for s in other["steps"]] != tokens[0]


@pytest.mark.parametrize("width", [None, "40"])
def test_tables_keep_whole_rows_at_any_width(tiny, tmp_path, width):
    text, trace = inspect(tiny, tmp_path, *(["--width", width] if width else []))
    lines = text.splitlines()
    header = [line for line in lines if "final p after cuts" in line]
    assert header and all(w in header[0] for w in ("token", "id", "logit", "p (T=1)", "p after T"))
    chosen = trace["steps"][0]["sample"]["token"]
    assert any(line.lstrip().startswith("▶") and f" {chosen} " in line for line in lines)
    timing = [line for line in lines if "phase" in line and "speed" in line]
    assert timing and "tokens" in timing[0] and "time" in timing[0]
    decode_rows = [line for line in lines if re.match(r"^\s*decode \d+\s+1\s", line)]
    assert len(decode_rows) == len(trace["steps"]) - 1


@pytest.mark.slow
def test_speculation_shows_each_verification(smollm_path, tmp_path):
    """--speculative ngram on a prompt the answer copies: the view prints each
    verification's guesses, and the trace's steps account for every token emitted."""
    prompt = (
        "Repeat exactly: The lighthouse keeper climbed the spiral stairs. "
        "Again: The lighthouse keeper"
    )
    text, trace = inspect(
        smollm_path, tmp_path, "--speculative", "ngram", "--max-tokens", "8",
        "--temperature", "0", prompt=prompt,
    )  # fmt: skip
    verify = [s for s in trace["steps"] if s["phase"] == "verify"]
    assert verify, "the copied prompt gives the n-gram lookup a match"
    assert "· verify" in text and "guess 1" in text and "rolled back" in text
    for step in verify:
        sp = step["speculation"]
        assert len(step["samples"]) == sp["emitted"] >= 1
        assert step["input_ids"][1:] == sp["proposed"]
    sampling = [s for s in trace["steps"] if "sample" in s]
    emitted = sum(len(s.get("samples", [s["sample"]])) for s in sampling)
    assert emitted == len(trace["summary"]["output_ids"])
    assert emitted > len(sampling)  # some guess was accepted: a step gave more than one token
