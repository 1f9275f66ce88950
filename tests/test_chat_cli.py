"""`tokenmill chat`: its slash commands, and a real session through a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from tokenmill.cli.chat import COMMANDS, Conversation, header

# ---------------------------------------------------------------------- the conversation


def test_messages_put_the_system_message_first():
    c = Conversation(system="Be brief.")
    c.turns += [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert c.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert Conversation().messages() == []


def test_clear_keeps_the_system_message():
    c = Conversation(system="Be brief.", turns=[{"role": "user", "content": "hi"}])
    assert c.command("/clear") == "new conversation"
    assert c.messages() == [{"role": "system", "content": "Be brief."}]


def test_system_sets_the_message_and_starts_anew():
    c = Conversation(turns=[{"role": "user", "content": "hi"}])
    assert c.command("/system") == "no system message"
    assert "set" in c.command("/system   You are a pirate.  ")
    assert c.messages() == [{"role": "system", "content": "You are a pirate."}]
    assert c.command("/system") == "system message: 'You are a pirate.'"


@pytest.mark.parametrize("line", ["/exit", "/quit", "/bye", "/exit now"])
def test_exit_commands_leave(line):
    assert Conversation().command(line) is None


def test_help_lists_every_command_and_unknown_ones_point_at_it():
    text = Conversation().command("/help")
    assert all(command in text for command in COMMANDS)
    assert "/help" in Conversation().command("/frobnicate")


def test_header_says_how_to_leave():
    line = header("smollm2-135m-instruct")
    assert "smollm2-135m-instruct" in line and "/exit" in line and "Ctrl-D" in line
    assert "/help" in line and "\n" not in line


# ---------------------------------------------------------------------- a real session

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\r")


class Terminal:
    """`tokenmill chat` on a pseudo-terminal, as a person runs it (stdin, stdout and stderr
    all a TTY), with what it drew read back as plain text."""

    def __init__(self, *args: str):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "chat", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, "TERM": "xterm", "COLUMNS": "120"},
            start_new_session=True,
        )
        os.close(slave)
        self.master = master
        self.raw = b""
        self.seen = 0  # how much of the text `expect` has consumed

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        self.raw += chunk
        return bool(chunk)

    def expect(self, pattern: str, timeout: float = 300) -> str:
        """Read until `pattern` appears after what earlier calls consumed; return that text."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.text[self.seen :])
            if match:
                start, self.seen = self.seen, self.seen + match.end()
                return self.text[start : self.seen]
            if time.monotonic() > deadline or not self._read(1.0):
                raise AssertionError(f"no {pattern!r} in:\n{self.text}")

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    def close(self) -> int:
        try:
            code = self.proc.wait(timeout=60)
        finally:
            while self._read(0.2):  # drain what it printed last
                pass
            os.close(self.master)
        return code


@pytest.mark.slow
def test_chat_session_on_a_terminal():
    term = Terminal("--max-tokens", "12", "--temperature", "0")
    try:
        top = term.expect(r"Ctrl-D to leave")
        assert "tokenmill chat · smollm2-135m-instruct · /help for commands · /exit" in top
        term.expect(r"> ")
        term.send("/help\n")
        shown = term.expect(r"> ")
        assert all(command in shown for command in COMMANDS)
        term.send("What is the capital of France?\n")
        answer = term.expect(r"tok/s[^\n]*finish: \w+")
        # a spinner ran until the first token, then the answer, then the speed line
        assert "thinking" in answer and "Paris" in answer
        assert answer.index("thinking") < answer.index("Paris")
        assert "time to first token" in answer
        term.expect(r"> ")
        term.send("/clear\n")
        assert "new conversation" in term.expect(r"> ")
        term.send("\x04")  # Ctrl-D
        code = term.close()
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert code == 0
    # Ctrl-D ended the "> " line, so the shell's prompt will start on a line of its own
    assert term.text.endswith("> \n"), repr(term.text[-40:])


def test_a_model_without_a_chat_template_is_refused_before_the_first_question(tmp_path):
    from helpers import build_hf_model

    build_hf_model("llama", tmp_path)  # its tokenizer has no chat template
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "chat", "--model", str(tmp_path)],
        input="hello\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == (
        f"tokenmill: error: {tmp_path.name} has no chat template; use tokenmill generate"
    )
    assert "/exit" not in r.stderr  # no header: the chat never opened
