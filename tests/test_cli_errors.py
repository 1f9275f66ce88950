"""Every argument error of the CLI, run as a user runs it: one line naming the problem, a
non-zero exit status, no traceback, and, for what only the model or the machine can
decide (a layer index, a regex, a port), no sign that the model started loading.

A loaded model always announces itself on stderr (its describe line: "... KV cache N
tokens ...") and a server its address ("serving ... at http://..."), so an error that
is the only line on stderr came before the weights loaded. No timing is involved.

The fast cases use a tiny random-weight llama (3 layers, 4 query heads over 2 K/V heads,
a 512-token context, a word-level tokenizer without a chat template); the slow test runs
the cases once met against the real default model.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )


def assert_one_line_error(r: subprocess.CompletedProcess, words: list[str]) -> str:
    """The run failed with exactly one line on stderr naming the problem, and nothing else
    happened: no traceback, no output, no model loaded, no server started."""
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and r.stderr.endswith("\n"), r.stderr  # nothing before the error
    (line,) = lines
    assert line.startswith("tokenmill") and ": error: " in line, line
    assert "KV cache" not in line and "serving" not in line and "Uvicorn" not in line
    for word in words:
        assert word in line, (word, line)
    return line


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from helpers import build_hf_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    build_hf_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("constraints")
    schema = folder / "if.json"  # "if" is a keyword llguidance does not implement
    schema.write_text(json.dumps({"type": "object", "if": {"required": ["a"]}}))
    grammar = folder / "bad.lark"
    grammar.write_text('start: foo\nfoo: "a" bar\n')  # `bar` is never defined
    return {"SCHEMA": schema, "GRAMMAR": grammar, "DIR": folder}


# (arguments, words the one line must contain); TINY stands for the tiny model's folder
TINY_CASES = [
    # structured output: compiled against the tokenizer by the engine's grammar compiler
    (["generate", "t5", "--regex", "["], ["argument --regex", "unclosed character class"]),
    (["generate", "t5", "--json-schema", "SCHEMA"], ["argument --json-schema", "not support: if"]),
    (["generate", "t5", "--grammar", "GRAMMAR"], ["argument --grammar", "unknown name", "bar"]),
    (["chat", "--regex", "("], ["argument --regex", "invalid regex"]),
    (["inspect", "t5", "--regex", "["], ["argument --regex", "invalid regex"]),
    # the attention map to draw, against the config in the model's header
    (["inspect", "t5", "--layer", "3"], ["argument --layer", "[0, 2]", "3 layers", "got 3"]),
    (["inspect", "t5", "--layer", "-1"], ["argument --layer", "[0, 2]", "got -1"]),
    (["inspect", "t5", "--head", "4"], ["argument --head", "[0, 3]", "4 query heads", "got 4"]),
    (["inspect", "t5", "--top-n", "0"], ["argument --top-n", ">= 1"]),
    # the prompt: empty, or too long for the context (512 positions)
    (["generate", ""], ["argument PROMPT", "is empty"]),
    (["generate", " ".join(["t7"] * 600)], ["argument PROMPT", "600 tokens", "context of 511"]),
    (["inspect", " ".join(["t7"] * 600)], ["argument PROMPT", "context of 511"]),
    (  # one block of 16 tokens
        ["generate", " ".join(["t7"] * 20), "--kv-cache-memory", "1tok"],
        ["argument PROMPT", "20 tokens", "context of 15"],
    ),
    (["generate", "t5", "--chat"], ["argument --chat", "no chat template", "without --chat"]),
    (["chat"], ["no chat template", "use tokenmill generate"]),
    # the KV pool, against this machine's memory
    (
        ["generate", "t5", "--kv-cache-memory", "1000000000000tok"],
        ["argument --kv-cache-memory", "1000000000000 tokens", "of memory"],
    ),
    # the parallel plan, against the heads and layers
    (["generate", "t5", "--tensor-parallel-size", "3"], ["--tensor-parallel-size", "2 K/V heads"]),
    (["generate", "t5", "--pipeline-parallel-size", "4"], ["--pipeline-parallel-size", "3 layers"]),
    (
        ["generate", "t5", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
        ["argument --pipeline-parallel-size", "not both"],
    ),
    (["serve", "--tensor-parallel-size", "3", "--port", "0"], ["--tensor-parallel-size"]),
    (["bench", "--pipeline-parallel-size", "9", "--peers", "none"], ["3 layers cannot fill 9"]),
    # devices torch has no use for here, whatever its build
    (["generate", "t5", "--device", "tpu"], ["argument --device", "torch_xla", "cpu, cuda"]),
    (["generate", "t5", "--device", "meta"], ["argument --device", "'meta'", "cpu, cuda"]),
    (["generate", "t5", "--device", ""], ["argument --device", "''"]),
    (["serve", "--device", "cuda:x"], ["argument --device", "'cuda:x'"]),
    (["generate", "t5", "--threads", "100000"], ["argument --threads", "at most", "CPUs"]),
    # outputs written when a run ends: checked before it starts
    (["inspect", "t5", "--json", "DIR/no/such/trace.json"], ["argument --json", "does not exist"]),
    (["inspect", "t5", "--json", "DIR"], ["argument --json", "is a folder"]),
    (["bench", "--json", "DIR/no/report.json", "--peers", "none"], ["argument --json"]),
    (["bench", "--plot", "DIR/no/chart.png", "--peers", "none"], ["argument --plot"]),
    # bench's sizes at parse time (they failed after torch loaded, or ran: --gemm-size 0)
    (["bench", "--runs", "0"], ["argument --runs", ">= 1, got 0"]),
    (["bench", "--gen-len", "1"], ["argument --gen-len", ">= 2, got 1"]),
    (["bench", "--gemm-size", "0"], ["argument --gemm-size", ">= 1, got 0"]),
    (["bench", "--bandwidth-mib", "x"], ["argument --bandwidth-mib", "'x'"]),
    # the server's names and address (a taken port has its own test below)
    (["serve", "--port", "99999"], ["argument --port", "[0, 65535]", "got 99999"]),
    (["serve", "--port", "-1"], ["argument --port", "[0, 65535]"]),
    (["serve", "--host", "192.0.2.1", "--port", "0"], ["argument --host", "192.0.2.1", "not an"]),
    (["serve", "--host", "no.such.host.invalid"], ["argument --host", "cannot resolve"]),
    (["serve", "--served-model-name", "", "--port", "0"], ["--served-model-name", "empty"]),
]


@pytest.mark.parametrize("args, words", TINY_CASES, ids=lambda v: str(v)[:60])
def test_an_argument_error_is_one_line_before_the_model_loads(args, words, tiny, files):
    args = [str(files[a]) if a in files else a for a in args]
    args = [a.replace("DIR", str(files["DIR"])) if a.startswith("DIR") else a for a in args]
    assert_one_line_error(run_cli(*args, "--model", str(tiny)), words)


def test_the_server_address_is_checked_before_the_model_is_even_found():
    """--host and --port are bound first: their errors come with a model path that does not
    exist, so nothing of the model was touched."""
    missing = "/no/such/model.gguf"
    r = run_cli("serve", "--port", "99999", "--model", missing)
    assert_one_line_error(r, ["--port"])
    r = run_cli("serve", "--host", "192.0.2.1", "--port", "0", "--model", missing)
    assert_one_line_error(r, ["--host", "not an address of this machine"])


def test_a_port_in_use_is_refused_before_the_model_loads(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("serve", "--port", str(port), "--model", str(tiny))
    line = assert_one_line_error(r, ["argument --port", f"127.0.0.1:{port}", "already in use"])
    assert r.returncode == 2 and "(see tokenmill serve --help)" in line


def _torch_cuda() -> tuple[bool, int]:
    import torch

    built = torch.backends.cuda.is_built()
    return built, torch.cuda.device_count() if built else 0


def test_a_device_this_torch_cannot_use_names_the_build_that_can(tiny):
    """On a CPU-only torch `--device cuda` names the builds that have CUDA; with CUDA but no
    GPU it says so; with GPUs, an index past the last is refused with the count."""
    import torch

    built, count = _torch_cuda()
    if not built:
        device, words = "cuda", ["built without CUDA", "CUDA build", "ROCm", torch.__version__]
    elif count == 0:
        device, words = "cuda", ["finds no GPU"]
    else:
        device, words = f"cuda:{count}", [f"cuda:{count} does not exist", f"{count} cuda"]
    r = run_cli("generate", "t5", "--model", str(tiny), "--device", device)
    assert_one_line_error(r, ["argument --device", *words])
    if not torch.backends.mps.is_built():
        r = run_cli("generate", "t5", "--model", str(tiny), "--device", "mps")
        assert_one_line_error(r, ["argument --device", "built without MPS", "macOS"])


def test_cpu_0_is_the_cpu(tiny):
    """torch's "cpu:0" is its one CPU device: the CPU kernels and their options apply."""
    from tokenmill import cli

    args = cli.build_parser().parse_args(
        ["generate", "t5", "--model", str(tiny), "--device", "cpu:0", "--quantization", "q8"]
    )
    cli.check_before_loading(args)
    assert args.device == "cpu"


def test_a_valid_constraint_compiled_before_loading_is_the_one_the_engine_uses(tiny):
    """The grammar compiled by the check is handed to the engine (its cache holds it), and
    the answer follows it. The constraint is on the tokens' own bytes ("t17t12": this word
    vocabulary's decoder puts the spaces between words); "( t1[0-9])+" allows no token's
    bytes after the first, and its request fails in one line (test_grammar)."""
    from tokenmill import cli

    parser = cli.build_parser()
    args = parser.parse_args(
        ["generate", "t5", "--model", str(tiny), "--regex", "(t1[0-9])+", "--max-tokens", "4"]
    )
    cli.check_before_loading(args)
    compiler = args.grammar_compiler
    assert len(compiler._cache) == 1
    llm = cli.load_llm(args)
    assert llm.engine.grammars is compiler
    (out,) = llm.generate("t5", cli._params(args))
    assert re.fullmatch(r"( t1[0-9]?){4}", out.text), out.text  # "t1": cut by max_tokens
    assert len(compiler._cache) == 1  # the request found it compiled


def test_serve_on_port_0_reports_the_port_it_got(tiny):
    """Port 0 binds a free port before the model loads; the log names that port (not 0) and
    the server answers there."""
    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", "0", "--model", str(tiny),
         "--kv-cache-memory", "4MiB"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )  # fmt: skip
    try:
        for line in proc.stderr:
            if m := re.search(r"serving \S+ at http://127\.0\.0\.1:(\d+)/v1", line):
                break
        else:
            pytest.fail(f"the server ended without serving (exit status {proc.wait()})")
        port = int(m[1])
        assert port != 0
        # the next line names the inspector page, the server's own web page
        assert f"the inspector page: http://127.0.0.1:{port}/" in next(proc.stderr)
        for _ in range(200):  # uvicorn listens a moment after the line
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
                break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            pytest.fail("no answer on the port the log names")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_issue_22_cases_with_the_default_model(smollm_path, files):
    """The errors once met on the default model, each before its weights load."""
    cases = [
        (["serve", "--port", "99999"], ["argument --port"]),
        (["generate", "hi", "--device", "tpu"], ["argument --device", "torch_xla"]),
        (["generate", "hi", "--regex", "["], ["argument --regex", "unclosed character class"]),
        (["generate", "hi", "--json-schema", str(files["SCHEMA"])], ["not support: if"]),
        (["inspect", "hi", "--layer", "99"], ["argument --layer", "[0, 29]", "got 99"]),
        (["inspect", "hi", "--head", "50"], ["argument --head", "[0, 8]", "got 50"]),
    ]
    if not _torch_cuda()[0]:
        cases.append((["generate", "hi", "--device", "cuda"], ["built without CUDA"]))
    for args, words in cases:
        assert_one_line_error(run_cli(*args, "--model", str(smollm_path)), words)
