"""`tokenmill chat`: an interactive conversation through the model's chat template.

It behaves the way users of `ollama run` and `llama-cli` expect: a one-line header
names the model and says how to leave; on a terminal a spinner runs until the first
token arrives; each answer streams to stdout and is followed by a dim speed line on
stderr. Slash commands manage the conversation (`COMMANDS`). Ctrl-C stops an answer
and returns to the prompt; Ctrl-D, /exit, /quit or /bye leave.

A reasoning model's thinking (its chat template mentions <think>: tokenizer/reasoning.py)
streams dimmed on stderr before the answer; `/think off` folds it into one line, `/think`
shows the last answer's thinking again. Only answers go back into the conversation.

Status text (header, speeds, command replies) goes to stderr, answers to stdout, so
`tokenmill chat < questions.txt > answers.txt` keeps the answers clean.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from dataclasses import dataclass, field

EXIT_COMMANDS = ("/exit", "/quit", "/bye")
COMMANDS = {
    "/help": "show these commands",
    "/clear": "start a new conversation (the system message stays)",
    "/system TEXT": "set the system message and start a new conversation; no TEXT: show it",
    "/think [on|off]": "show a reasoning model's thinking as it comes, or fold it into one "
    "line; no argument: show the last answer's thinking",
    "/exit": "leave (also /quit, /bye or Ctrl-D); Ctrl-C stops an answer",
}


def register(subparsers, add_model_args, add_sampling_args) -> None:
    from tokenmill.cli.common import add_precision_args, add_speculative_args

    p = subparsers.add_parser(
        "chat",
        help="interactive chat with the model's chat template",
        description="Chat with the model: each turn is rendered with its chat template. "
        "Type /help in the chat for its commands; /exit or Ctrl-D leaves.",
    )
    add_model_args(p)
    add_precision_args(p)
    add_speculative_args(p)
    add_sampling_args(p, max_tokens=512)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat, check_model=check_chat_template)


@dataclass
class Conversation:
    """The messages of one chat and the slash commands that change them (no I/O here)."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)
    show_thinking: bool = True  # a reasoning model's thinking streamed (else folded)
    last_thinking: str = ""

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def command(self, line: str) -> str | None:
        """Run slash command `line`. Returns the text to show, or None to leave."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in EXIT_COMMANDS:
            return None
        if name in ("/help", "/?"):
            width = max(len(c) for c in COMMANDS)
            return "\n".join(f"{c.ljust(width)}  {what}" for c, what in COMMANDS.items())
        if name == "/clear":
            self.turns.clear()
            return "new conversation"
        if name == "/system":
            if not rest:
                return f"system message: {self.system!r}" if self.system else "no system message"
            self.system = rest
            self.turns.clear()
            return "system message set; new conversation"
        if name == "/think":
            if rest in ("on", "off"):
                self.show_thinking = rest == "on"
                return f"thinking {'shown' if self.show_thinking else 'folded'}"
            if rest:
                return "usage: /think [on|off]"
            return self.last_thinking or "no thinking in the last answer"
        return f"unknown command {name!r}; /help lists the commands"


def header(model_name: str) -> str:
    return f"tokenmill chat · {model_name} · /help for commands · /exit or Ctrl-D to leave"


def check_chat_template(args: argparse.Namespace, facts) -> None:
    """Refuse a model without a chat template before its weights load, not after the first
    question (cli/common.py's check_before_loading; facts: ModelFacts). A --system message is
    rendered once, so a template that refuses system messages says so now too."""
    from tokenmill.tokenizer import ChatTemplateError

    tokenizer = facts.tokenizer()
    if tokenizer.chat_template is None:
        raise ChatTemplateError(f"{facts.name} has no chat template; use tokenmill generate")
    if args.system:
        conversation = Conversation(system=args.system)
        tokenizer.encode_chat([*conversation.messages(), {"role": "user", "content": "hi"}])


def _think(conversation: Conversation, console, thought: list[str], text: str) -> None:
    """One piece of the thinking: kept for /think, shown dimmed on stderr unless folded."""
    thought.append(text)
    if conversation.show_thinking:
        console.print(text, style="dim", highlight=False, end="", soft_wrap=True)


def cmd_chat(args: argparse.Namespace) -> None:
    from tokenmill import hub
    from tokenmill.cli.common import _params, load_llm, stderr_console
    from tokenmill.cli.generate import speed_line, stream_answer
    from tokenmill.tokenizer.reasoning import AUTO, resolve

    params = _params(args)
    llm = load_llm(args)
    reasoning = resolve(AUTO, llm.tokenizer.chat_template)
    if reasoning is not None:  # the thinking apart from the answer (dimmed, foldable)
        params = dataclasses.replace(params, reasoning=reasoning)
    console = stderr_console()
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    conversation = Conversation(system=args.system)
    console.print(header(hub.display_name(args.model)), style="bold", highlight=False)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:  # Ctrl-D: end the "> " line so the shell prompt starts clean
                sys.stdout.write("\n")
            break
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            console.print("(Ctrl-D or /exit to leave)", style="dim", highlight=False)
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            reply = conversation.command(line)
            if reply is None:
                break
            console.print(reply, style="dim", highlight=False)
            continue
        conversation.turns.append({"role": "user", "content": line})
        thought: list[str] = []
        try:
            answer, done = stream_answer(
                llm,
                llm.chat_prompt(conversation.messages()),
                params,
                console,
                functools.partial(_think, conversation, console, thought),
            )
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            conversation.turns.pop()  # a cut-off answer is not kept in the conversation
            console.print("(answer stopped)", style="dim", highlight=False)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        conversation.last_thinking = "".join(thought)
        if thought and not conversation.show_thinking:
            words = len(conversation.last_thinking.split())
            console.print(f"(thought {words} words; /think shows them)", style="dim")
        console.print(speed_line(done), style="dim", highlight=False, soft_wrap=True)
        conversation.turns.append({"role": "assistant", "content": answer})
