"""The command line before any model runs: help, argument errors, `info`, start-up imports.

These need no model weights: they are in the fast subset. What a command does with a
model is tested in test_api_cli.py, test_chat_cli.py and test_inspect_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill import cli, hub
from tokenmill.units import format_rate, parse_memory

REPO = Path(__file__).resolve().parent.parent

# Runs `tokenmill ARGS` as the console script does, then reports how it exited and whether
# torch was imported on the way: the start-up cost a user waits for, measured without a timer.
_PROBE = textwrap.dedent(
    """
    import json, sys
    from tokenmill.cli import main
    try:
        main(sys.argv[1:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    print("@@probe " + json.dumps({"code": code, "torch": "torch" in sys.modules}))
    """
)


def probe(*args: str, env: dict[str, str] | None = None) -> tuple[dict, str, str]:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    out, _, result = r.stdout.rpartition("@@probe ")
    assert result, f"probe died: {r.stderr}"
    return json.loads(result), out, r.stderr


@pytest.fixture(scope="module")
def junk_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("junk") / "model.gguf"
    path.write_bytes(b"junk" * 8)
    return path


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        [],
        *([command, "--help"] for command in ("generate", "chat", "serve", "inspect", "bench")),
        ["info", "--help"],
    ],
    ids=lambda a: " ".join(a) or "bare",
)
def test_help_answers_without_importing_torch(args):
    result, out, err = probe(*args)
    assert result == {"code": 0, "torch": False}, err
    assert "usage: tokenmill" in out or out.startswith("tokenmill 0.")


BAD_ARGS = [
    # (args, exit code, words the one line must contain)
    (["generate"], 2, ["PROMPT"]),
    (["generate", "hi", "--max-tokens", "x"], 2, ["--max-tokens", "'x'"]),
    (["generate", "hi", "--top-p", "3"], 2, ["--top-p", "(0.0, 1.0]", "got 3.0"]),
    (["chat", "--top-k", "-5"], 2, ["--top-k", "got -5"]),
    (["inspect", "hi", "--temperature", "-1"], 2, ["--temperature", ">= 0"]),
    (["generate", "hi", "--threads", "0"], 2, ["--threads", ">= 1"]),
    (["generate", "hi", "--stop", ""], 2, ["--stop", "empty"]),
    (["generate", "hi", "--kv-cache-memory", "lots"], 2, ["--kv-cache-memory", "'lots'"]),
    (["inspect", "hi", "--width", "5"], 2, ["--width", "40"]),
    (["generate", "hi", "--activation-bits", "4"], 2, ["--activation-bits", "invalid choice: 4"]),
    (["serve", "--activation-bits", "12"], 2, ["--activation-bits", "invalid choice: 12"]),
    (["serve", "--port", "x"], 2, ["--port"]),
    (["frobnicate"], 2, ["unknown command 'frobnicate'", "generate, chat, serve"]),
    (["serv"], 2, ["unknown command 'serv'; did you mean 'serve'?"]),
    (["doctr"], 2, ["unknown command 'doctr'; did you mean 'doctor'?"]),
    (["generate", "hi", "--model", "/no/such/model.gguf"], 1, ["/no/such/model.gguf", "known"]),
    (["generate", "hi", "--model", "JUNK"], 1, ["not a GGUF file", "b'junk'"]),
    (["generate", "hi", "--model", "EMPTY_DIR"], 1, ["no config.json", "not a Hugging Face"]),
    (["serve", "--model", "EMPTY_DIR"], 1, ["no config.json", "not a Hugging Face"]),
    (["generate", "hi", "--json-schema", "/no/schema.json"], 2, ["--json-schema", "No such file"]),
    (["generate", "hi", "--json-schema", "JUNK"], 2, ["--json-schema", "not valid JSON"]),
    (["chat", "--regex", "a", "--choice", "b"], 2, ["at most one of", "regex and choice"]),
    (["inspect", "hi", "--grammar", "/no/grammar.lark"], 2, ["--grammar", "cannot read"]),
]


@pytest.mark.parametrize("args, code, words", BAD_ARGS, ids=lambda v: str(v))
def test_bad_arguments_are_one_line_without_torch(args, code, words, junk_gguf, tmp_path):
    placeholders = {"JUNK": str(junk_gguf), "EMPTY_DIR": str(tmp_path)}
    args = [placeholders.get(a, a) for a in args]
    result, out, err = probe(*args)
    assert result == {"code": code, "torch": False}
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert err.startswith("tokenmill") and ": error: " in err
    for word in words:
        assert word in err
    if code == 2:  # argparse's own errors point at the command's --help
        assert "see tokenmill" in err and "--help)" in err


def test_load_error_after_torch_is_one_line_too(tmp_path):
    """A file that passes the header check but fails inside the loader: one line on stderr,
    and no blank line before it (the transient progress bar leaves none off a terminal)."""
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 60)
    result, out, err = probe("generate", "hi", "--model", str(path))
    assert result["code"] == 1
    assert err.count("\n") == 1 and err.startswith("tokenmill: error: ") and str(path) in err


def _help(*command: str) -> str:
    parser = cli.build_parser()
    for action in parser._subparsers._group_actions:
        if command and command[0] in action.choices:
            parser = action.choices[command[0]]
    return " ".join(parser.format_help().split())  # one line: the wrapping is the terminal's


def test_help_shows_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    generate = _help("generate")
    for shown in (
        "most tokens to generate per answer (default: 128)",
        "(default: 0.7)",
        "(1 = off) (default: 1.0)",
        "(0 = off) (default: 0)",
        "(default: float32)",
        "(default: all cores)",
        "min(1 GiB, RAM/16) on CPU",
        f"default: {hub.DEFAULT_MODEL}",
        "(default: a fresh one each run)",
    ):
        assert shown in generate
    assert "default: None" not in generate and "default: False" not in generate
    assert "most tokens to generate per answer (default: 512)" in _help("chat")
    inspect = _help("inspect")
    assert "(default: 0.9)" in inspect and "two runs draw the same tokens (default: 0)" in inspect
    serve = _help("serve")
    assert "(default: 8000)" in serve and "(default: 64)" in serve
    # what serve serves, beyond the OpenAI API: the other APIs and the inspector page
    assert "Anthropic's /v1/messages" in serve and "the inspector page" in serve
    for command in ("generate", "chat", "serve", "bench"):
        assert "--activation-bits {8,16}" in _help(command)


def test_version():
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "--version"], capture_output=True, text=True
    )
    import tokenmill

    assert r.returncode == 0 and r.stdout.strip() == f"tokenmill {tokenmill.__version__}"


def test_info_lists_what_a_bug_report_needs():
    import torch

    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "doctor"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines() if line.strip())
    assert lines["torch"].startswith(torch.__version__)
    assert lines["threads"].split()[0].isdigit()
    from tokenmill import kernels

    isa = kernels.isa()
    assert lines["kernels"] == isa or (isa == "none" and lines["kernels"].startswith("none:"))
    assert lines["cache"] == str(hub.cache_dir())
    models = [line for line in r.stdout.splitlines() if line.startswith("model")]
    assert len(models) == len(hub.KNOWN_MODELS)
    for name in hub.KNOWN_MODELS:
        assert any(f" {name}" in line for line in models)


def test_hub_runs_as_a_module_without_a_warning(tmp_path):
    """`python -m tokenmill.hub` used to warn (runpy) because `import tokenmill` imported
    tokenmill.hub first. A cache holding the file already means nothing is downloaded."""
    model = hub.KNOWN_MODELS[hub.DEFAULT_MODEL]
    (tmp_path / model.filename).write_bytes(b"GGUF")
    r = subprocess.run(
        [sys.executable, "-W", "error", "-m", "tokenmill.hub", hub.DEFAULT_MODEL],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENMILL_CACHE": str(tmp_path)},
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.strip() == str(tmp_path / model.filename)


def test_importing_tokenmill_is_light():
    code = "import sys, tokenmill; print('torch' in sys.modules); tokenmill.LLM; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "True"], r.stderr  # LLM itself still works


# ---------------------------------------------------------------------- model names


def test_names_a_client_may_use():
    cached = Path("/cache") / hub.KNOWN_MODELS[hub.DEFAULT_MODEL].filename
    names = hub.names_for(None, cached)
    assert names[0] == hub.DEFAULT_MODEL
    assert {"SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1", "smollm2"} <= set(
        names
    )
    assert hub.names_for(str(cached), cached)[0] == cached.name  # a path shows as its file
    assert hub.DEFAULT_MODEL in hub.names_for(str(cached), cached)  # ... and is still known
    other = Path("/models/my-model.Q8_0.gguf")
    assert hub.names_for(str(other), other) == ["my-model.Q8_0.gguf", "my-model.Q8_0"]


def test_served_model_name_flag_replaces_the_names():
    from tokenmill.server.cli import served_model_names

    parser = cli.build_parser()
    path = Path("/m/x.gguf")
    args = parser.parse_args(["serve", "--served-model-name", "a", "b"])
    assert served_model_names(args, path) == ["a", "b"]
    args = parser.parse_args(["serve", "--model", str(path)])
    assert served_model_names(args, path) == ["x.gguf", "x"]


# ---------------------------------------------------------------------- units


@pytest.mark.parametrize(
    "rate, text",
    [(0.3, "0.300"), (0.04, "0.0400"), (2.954, "2.95"), (12.34, "12.3"), (212.9, "213"),
     (1234.5, "1,234"), (0.0, "0")],
)  # fmt: skip
def test_format_rate(rate, text):
    assert format_rate(rate) == text


@given(st.floats(min_value=1e-6, max_value=1e7))
def test_format_rate_never_shows_a_positive_speed_as_zero(rate):
    shown = float(format_rate(rate).replace(",", ""))
    assert shown > 0 and abs(shown - rate) <= 0.006 * rate + 0.5 * (rate >= 1000)


@pytest.mark.parametrize(
    "text, value",
    [("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("8192tok", -8192), ("1e9", 10**9),
     ("1.5 GiB", 3 << 29)],
)  # fmt: skip
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["lots", "0", "-5MiB", "tok", "nanGB", ""])
def test_parse_memory_refuses_with_the_forms_it_takes(text):
    with pytest.raises(ValueError, match="'512MiB'"):
        parse_memory(text)


@pytest.mark.parametrize("value", [0, -1, -(2**20)])
def test_parse_memory_refuses_non_positive_byte_counts(value):
    """A negative int is how parse_memory spells a token count; as input it is a typo."""
    with pytest.raises(ValueError, match="positive number of bytes"):
        parse_memory(value)
