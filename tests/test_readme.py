"""README.md and every page of docs/, run as a reader runs them, so that they cannot drift
from the code again.

Every fenced block of each of those files is one of three kinds, and each kind is checked:

  bash    Each `tokenmill ...` command runs on the real default model and must succeed
          (and show what the README says it shows), except the few in NOT_RUN, whose
          arguments are parsed instead, as are those of a `torchrun ... -m tokenmill.cli`
          launch. Install steps must be the ones scripts/test.sh, which CI runs, performs.
  python  Each snippet runs in a fresh interpreter, from a folder outside the clone; one
          that talks to http://127.0.0.1:8000 runs against a real `tokenmill serve` (on a
          free port) with the real `openai` client. Every `# prints: TEXT` comment is
          checked against what the snippet printed (`...` matches anything), and every
          module a snippet imports must import in a fresh venv set up by exactly the
          quickstart's install steps.
  text    Usage synopses: every option they show exists on that command, and every value
          shown that is not a PLACEHOLDER is the option's default or among its choices.

A block of any other kind fails the test, so nothing in the README or docs/ escapes
checking. Every relative link of those files (and of CHANGELOG.md) must lead to a file
that exists, and to a heading of it where it names one; the README stays a front door
(at most README_MAX_LINES lines) whose index links every page of docs/.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tokenmill import cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
# The pages whose blocks are checked: the README first, then docs/ (a page added there is
# checked without being listed here).
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
TEXTS = {page: (REPO / page).read_text() for page in PAGES}
README_MAX_LINES = 250
TEST_SH = (REPO / "scripts" / "test.sh").read_text()
SERVER_URL = "http://127.0.0.1:8000"

# Commands a reader would run but a test cannot: their arguments are parsed instead.
NOT_RUN = {
    "bench": "takes long and pip-installs its peers; tests/test_bench_quick.py runs --quick",
    "serve": "runs until stopped; the server snippets run against one instead",
    "pull": "reaches the Hugging Face Hub; tests/test_hf_names.py pulls from a stand-in",
}
# What the README promises a command prints (stdout), checked when it runs.
PROMISED = {
    "generate": "The capital of France is Paris.",
    "inspect": "Timing: prefill vs decode",
}


def blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, language, code) of each fenced block."""
    found = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        found.append((text.count("\n", 0, m.start()) + 1, m[1], m[2]))
    return found


# (page, line number, language, code) of every fenced block of every page.
BLOCKS = [(page, *block) for page in PAGES for block in blocks(TEXTS[page])]
README_BLOCKS = [(line, lang, code) for page, line, lang, code in BLOCKS if page == "README.md"]


def cases(kind: str) -> list:
    """The blocks of one kind as test cases; those that run a model are marked slow."""
    out = []
    for page, line, lang, code in BLOCKS:
        if lang == kind:
            slow = kind == "python" or (kind == "bash" and _runs_a_model(code))
            marks = [pytest.mark.slow] if slow else []
            out.append(pytest.param(code, id=f"{page}:{line}", marks=marks))
    return out


def _runs_a_model(code: str) -> bool:
    return any(w[0] == "tokenmill" and w[1] not in NOT_RUN for w in commands(code))


def test_every_block_is_of_a_kind_this_file_checks():
    assert README_BLOCKS, "no code blocks found in README.md"
    assert len(PAGES) > 1, "no pages found in docs/"
    kinds = {(page, lang) for page, _, lang, _ in BLOCKS}
    assert {lang for _, lang in kinds} <= {"bash", "python", "text"}, kinds


def test_blocks_finds_every_fence():
    """Every page's fences pair up into blocks: an unclosed or mislabelled fence would hide
    the code after it from every check here."""
    for page, text in TEXTS.items():
        fences = re.findall(r"^```", text, re.M)
        assert len(fences) == 2 * len(blocks(text)), f"{page}: unpaired ``` fences"


def test_quickstart_promise_is_the_one_checked():
    assert f"prints `{PROMISED['generate']}`" in README


def test_every_chat_command_is_in_the_docs():
    """The chat's /help and docs/cli.md's chat paragraph name the same commands."""
    from tokenmill.cli.chat import COMMANDS, EXIT_COMMANDS

    cli_page = TEXTS["docs/cli.md"]
    for command in [*COMMANDS, *EXIT_COMMANDS]:
        assert f"`{command.split()[0]}" in cli_page, f"docs/cli.md never mentions {command}"


# ---------------------------------------------------------------------- links and the index


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (outside code blocks); a repeated heading
    gets `-1`, `-2`, ... as on GitHub."""
    found: set[str] = set()
    for m in re.finditer(
        r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M
    ):
        base = anchor = slug(m[1])
        n = 0
        while anchor in found:
            n += 1
            anchor = f"{base}-{n}"
        found.add(anchor)
    return found


def links(text: str) -> list[str]:
    """The relative targets of a markdown file's inline links, code blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code spans hold no links
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_slug_and_links():
    assert slug("Server (OpenAI-compatible)") == "server-openai-compatible"
    assert slug("OpenAI's Responses API") == "openais-responses-api"
    assert slug("Models of a real shape: `tokenmill bench --shape NAME[:TYPE]`") == (
        "models-of-a-real-shape-tokenmill-bench---shape-nametype"
    )
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}
    assert links("[x](a.md#b) [y](https://e.org) `[z](c.md)`") == ["a.md#b"]


@pytest.mark.parametrize("page", [*PAGES, "CHANGELOG.md"])
def test_relative_links_lead_somewhere(page):
    """Every relative link leads to a file of the repository, and to one of its headings
    where it names one: moving text between pages cannot leave a dead link behind."""
    here = (REPO / page).parent
    for target in links((REPO / page).read_text()):
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else REPO / page
        assert file.exists(), f"{page} links to {target}, which does not exist"
        assert file.is_relative_to(REPO), f"{page} links outside the repository: {target}"
        if anchor:
            assert file.suffix == ".md", f"{page}: an anchor into a non-markdown file: {target}"
            assert anchor in anchors(file.read_text()), f"{page}: no heading #{anchor} in {path}"


def test_readme_is_a_front_door():
    """The README stays short, and its index links every page of docs/."""
    assert README.count("\n") <= README_MAX_LINES, "README.md grew: move the detail to docs/"
    linked = {t.partition("#")[0] for t in links(README)}
    for page in PAGES[1:]:
        assert page in linked, f"README.md's index does not link {page}"


# ---------------------------------------------------------------------- bash


def commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: lines joined at `\\`, split at `&&`."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            head, _, words = _partition(words, "&&")
            out.append(head)
    return out


def _partition(words: list[str], sep: str) -> tuple[list[str], str, list[str]]:
    if sep in words:
        i = words.index(sep)
        return words[:i], sep, words[i + 1 :]
    return words, "", []


def extras() -> dict[str, list[str]]:
    """pyproject.toml's optional dependencies: {extra: [requirement, ...]}."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def check_install_step(words: list[str]) -> None:
    """The README's install steps are the ones CI performs through scripts/test.sh: the
    extras the README installs are covered by the `test` extra that scripts/test.sh
    installs, so CI has every package a reader gets."""
    line = " ".join(words)
    if words[:2] == ["pip", "install"]:
        torch = [w for w in words if w.startswith("torch")]
        if torch:
            assert f"pip install -q {torch[0]}" in TEST_SH, f"README pins {torch[0]}"
        else:
            m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", words[-1])
            assert words[2:-1] == ["-e"] and m, f"README installs {line!r}"
            assert "pip install -q -e '.[test]'" in TEST_SH
            for extra in (m[1] or "").split(","):
                if extra:
                    missing = set(extras()[extra]) - set(extras()["test"])
                    assert not missing, f"the test extra lacks {missing} of {extra!r}"
    elif words[:2] == ["bash", "scripts/test.sh"]:
        assert "exec bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
        if "-m" in words:  # a marker expression: its markers must be registered
            registered = (REPO / "pyproject.toml").read_text()
            for marker in re.findall(r"\w+", words[words.index("-m") + 1]):
                assert marker in ("not", "and", "or") or f'"{marker}:' in registered
    else:
        assert line in TEST_SH, f"README step {line!r} is not what scripts/test.sh does"


def run_tokenmill(words: list[str], tmp_path: Path) -> None:
    command = words[1]
    if command in NOT_RUN:
        cli.build_parser().parse_args(words[1:])  # exits (fails the test) if they are wrong
        return
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *words[1:]],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, f"{shlex.join(words)}:\n{r.stderr}"
    assert PROMISED.get(command, "") in r.stdout, r.stdout


def check_torchrun(words: list[str]) -> None:
    """A multi-machine launch cannot run here: its tokenmill arguments are parsed."""
    assert "-m" in words and words[words.index("-m") + 1] == "tokenmill.cli", words
    cli.build_parser().parse_args(words[words.index("-m") + 2 :])  # exits if they are wrong


@pytest.mark.parametrize("code", cases("bash"))
def test_bash_block(code, tmp_path):
    for words in commands(code):
        if words[0] == "tokenmill":
            run_tokenmill(words, tmp_path)
        elif words[0] == "torchrun":
            check_torchrun(words)
        else:
            check_install_step(words)


# ---------------------------------------------------------------------- python


@pytest.fixture(scope="module")
def server_url():
    from server_fixture import running_server

    with running_server() as url:  # the default model, with its default served names
        yield url


@pytest.mark.parametrize("code", cases("python"))
def test_python_block(code, tmp_path, request):
    if SERVER_URL in code:
        code = code.replace(SERVER_URL, request.getfixturevalue("server_url"))
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,  # outside the clone, as a user's script is
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")
    for promise in promises(code):
        assert printed(promise, r.stdout), f"README promises {promise!r}; it printed:\n{r.stdout}"


def promises(code: str) -> list[str]:
    """The TEXT of each `# prints: TEXT` comment of a snippet, in order."""
    return [m[1].strip() for m in re.finditer(r"#\s*prints:\s*(.+)$", code, re.M)]


def printed(promise: str, stdout: str) -> bool:
    """Whether `stdout` has the promised text, `...` matching anything (even newlines)."""
    pattern = ".*?".join(re.escape(part.strip()) for part in promise.split("..."))
    return re.search(pattern, stdout, re.S) is not None


def test_promise_matching():
    assert printed("Paris. stop ...", " Paris. stop 42.1\n")
    assert printed("... Rayleigh scattering...", "lies in\nRayleigh scattering. This\n")
    assert printed(
        "The weather in Tokyo is ... 21 degrees", "The weather in Tokyo is nice, 21 degrees"
    )
    assert not printed("The capital of Japan is Tokyo.", "The capital of Japan is Kyoto.\n")
    assert not printed("a ... b", "b a")


@pytest.mark.parametrize("code", [c.values[0] for c in cases("python")])
def test_python_block_says_what_it_prints(code):
    """Every snippet shows its real output, so a reader sees what the model gets right."""
    assert promises(code), "a python block without a `# prints:` comment"


# ---------------------------------------------------------------------- the quickstart's venv

# A fresh clone's files: what the copy of the working tree leaves out.
NOT_COPIED = (
    ".git",
    ".venv",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    ".*_cache",
    ".hypothesis",
)
NOT_COPIED += ("test-artifacts", "*.gguf", "*.safetensors")


def quickstart_install() -> str:
    """The quickstart's first command up to its first `tokenmill` command: the install."""
    line = next(c for _, lang, c in README_BLOCKS if lang == "bash" and "python3 -m venv" in c)
    steps = line.strip().split(" && ")
    return " && ".join(steps[: next(i for i, s in enumerate(steps) if s.startswith("tokenmill"))])


def snippet_imports(code: str) -> set[str]:
    """The top-level modules a python snippet imports."""
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.fixture(scope="session")
def quickstart_venv(tmp_path_factory) -> Path:
    """A copy of the clone with a venv made by the quickstart's install steps, run as
    written by bash in the copy (no site packages of the test environment): its python.
    About a minute on 2 cores (torch's wheel from the local cache), once per session."""
    clone = tmp_path_factory.mktemp("fresh") / "tokenmill"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns(*NOT_COPIED))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    if sys.prefix != sys.base_prefix:  # python3 as a new user finds it, not the test venv's
        venv_bin = str(Path(sys.prefix) / "bin")
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    start = time.monotonic()
    r = subprocess.run(
        ["bash", "-c", quickstart_install()],
        cwd=clone, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert r.returncode == 0, f"{quickstart_install()}:\n{r.stderr[-3000:]}"
    print(f"\nquickstart install: {time.monotonic() - start:.0f} s", file=sys.stderr)
    return clone / ".venv" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.parametrize("code", cases("python"))
def test_python_block_imports_in_the_quickstart_venv(code, quickstart_venv, tmp_path):
    modules = sorted(snippet_imports(code))
    r = subprocess.run(
        [str(quickstart_venv), "-c", "; ".join(f"import {m}" for m in modules)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, f"after the quickstart, import {', '.join(modules)}:\n{r.stderr}"


# ---------------------------------------------------------------------- text (synopses)

PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*(\.\.\.)?")


def synopses(code: str) -> list[str]:
    """Each `tokenmill ...` usage line with its indented continuation lines."""
    out: list[str] = []
    for line in code.splitlines():
        if line.startswith("tokenmill"):
            out.append(line)
        elif line.startswith(" ") and out:
            out[-1] += " " + line.strip()
    return out


def _subparser(command: str | None) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    if command is None:
        return parser
    for action in parser._subparsers._group_actions:
        if command in action.choices:
            return action.choices[command]
    raise AssertionError(f"the docs show `tokenmill {command}`, which does not exist")


@pytest.mark.parametrize("code", cases("text"))
def test_usage_block(code):
    usages = synopses(code)
    assert usages, "a text block that is not a usage synopsis"
    for usage in usages:
        words = usage.split()
        command = None if words[1].startswith("-") else words[1]
        parser = _subparser(command)
        options = parser._option_string_actions
        for option in re.findall(r"(?<![\w\[])--[\w-]+", usage):  # bare options
            assert option in options, f"{usage}: no {option}"
        for option, value in re.findall(r"\[(--[\w-]+)(?: ([^\]]+))?\]", usage):
            assert option in options, f"{usage}: no {option}"
            action = options[option]
            if not value or PLACEHOLDER.fullmatch(value):
                continue
            if "|" in value:
                assert set(value.split("|")) <= set(action.choices), f"{option} {value}"
            else:
                assert value == str(action.default) or (
                    isinstance(action.default, float) and float(value) == action.default
                ), f"README shows {option} {value}; its default is {action.default}"
