"""What every command shares: the model and sampling options, the checks before the
weights load (`check_before_loading`, in the order the package's docstring gives), and the
loading itself (`load_llm`, with a progress bar). Torch-free to import: the parser
(cli/__init__.py) is built from these before anything heavy loads.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from tokenmill import hub
from tokenmill.checks import ArgumentError, ParamError, int_at_least


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after each option's help, except where there is nothing to show
    (no default, a flag that is off) or the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is None
            or action.default is False  # a flag that is off (`in` would also match 0)
            or action.default == argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line that names the problem and points at
    --help (argparse prints the whole usage block, which buries the one line that matters).
    Subcommand parsers are made with this class too (argparse uses the parent's type)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # A mistyped command is most often a near miss (`serv`): name the command it was
        # probably meant to be instead of argparse's list of every choice.
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            raise argparse.ArgumentError(None, unknown_command_message(value, action.choices))
        super()._check_value(action, value)


def unknown_command_message(name: str, commands: Iterable[str]) -> str:
    commands = list(commands)
    close = difflib.get_close_matches(name, commands, n=1)
    if close:
        return f"unknown command {name!r}; did you mean {close[0]!r}?"
    return f"unknown command {name!r}; the commands are {', '.join(commands)}"


# ---------------------------------------------------------------------- argument types


positive_int = int_at_least(1)


def thread_count(text: str) -> int:
    """An argparse type: a thread count in [1, the machine's CPUs]. More threads than CPUs
    only wait on each other, and libgomp crashes creating tens of thousands of them."""
    cpus = os.cpu_count() or 1
    value = int_at_least(1)(text)
    if value > cpus:
        raise argparse.ArgumentTypeError(
            f"must be at most {cpus}, the CPUs of this machine, got {value}"
        )
    return value


def memory_size(text: str) -> str:
    """Checks a --kv-cache-memory value now; the engine parses the same text later."""
    from tokenmill.units import parse_memory

    try:
        parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("kv_cache_memory ")) from None
    return text


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        metavar="M",
        help=f"checkpoint folder, .gguf file or known model name ({', '.join(hub.KNOWN_MODELS)}); "
        f"default: {hub.DEFAULT_MODEL}",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of activations, KV cache and unquantized weights",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="cpu, or a GPU through torch: cuda[:N] (NVIDIA or AMD), mps (Apple), xpu (Intel)",
    )
    p.add_argument(
        "--threads",
        type=thread_count,
        default=None,
        metavar="N",
        help="CPU threads (default: all cores)",
    )
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "gguf", "float", "q8", "q4"],
        help="auto: keep weights as the file stores them for the native kernels (fast); "
        "none: torch float weights",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="KV cache pool size: bytes ('512MiB', '2GB') or tokens ('8192tok') "
        "(default: min(1 GiB, RAM/16) on CPU, half the free memory on a GPU)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="split every layer over N processes (spawned here, or torchrun's ranks)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the layers into N consecutive stages, one process each",
    )


def speculative_method(text: str) -> str:
    """--speculative's value: "ngram" or "draft:PATH" (a path or a model name)."""
    if text == "ngram" or (text.startswith("draft:") and len(text) > len("draft:")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not ngram or draft:PATH")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """--speculative and --num-speculative-tokens (engine/speculative.py); load_llm hands
    them to the engine. generate, chat and inspect take them; serve may (server/cli.py)."""
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--speculative",
        default=None,
        type=speculative_method,
        metavar="ngram|draft:PATH",
        help="guess the next tokens and verify them in one step; ngram: look the last "
        "1-4 tokens up in the prompt and output (pays on text that repeats its input: "
        "edits, quotes, answers from a passage); draft:PATH: a smaller model with the "
        "same tokenizer proposes them",
    )
    s.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=4,
        metavar="K",
        help="most guesses per step (default: 4)",
    )


def add_precision_args(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --activation-bits (LLMEngine's kv_cache_dtype and
    activation_bits); the dtype is checked against the engine's list by model_facts before
    loading, and load_llm hands both to the engine. generate, chat, bench and serve take
    them."""
    p.add_argument(
        "--activation-bits",
        type=int,
        choices=(8, 16),
        default=16,
        metavar="{8,16}",
        help="what packed weights' kernels quantize activations to, per 32 values: 16 (the "
        "default: greedy tokens match the float model's) or 8 (llama.cpp's q8 scheme: "
        "faster on VNNI and AVX2 CPUs, above all for batches and prefill)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help="what the KV cache stores: auto (the activations' dtype, --dtype), float32, "
        "float16, bfloat16 or q8_0 (llama.cpp's 8-bit blocks); 16 bits hold twice the "
        "tokens of float32 in the same --kv-cache-memory, q8_0 3.76 times",
    )


def speculative_option(args: argparse.Namespace) -> dict[str, Any] | None:
    """The engine's speculative= for parsed arguments (None: off, or not offered)."""
    method = getattr(args, "speculative", None)
    if method is None:
        return None
    return {"method": method, "k": args.num_speculative_tokens}


def _add_sampling_args(
    p: argparse.ArgumentParser, max_tokens: int, seed: int | None = None
) -> None:
    p.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        metavar="N",
        help="most tokens to generate per answer",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        metavar="T",
        help="sampling temperature; 0 = greedy (the most likely token, same text every run)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: keep the top mass P (1 = off)",
    )
    p.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)"
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens below P times the top token's probability (0 = off)",
    )
    p.add_argument(
        "--typical-p",
        type=float,
        default=1.0,
        metavar="P",
        help="locally typical sampling: keep the tokens nearest the entropy up to mass P (1 = off)",
    )
    p.add_argument(
        "--top-n-sigma",
        type=float,
        default=0.0,
        metavar="N",
        help="keep the logits within N standard deviations of the largest (0 = off)",
    )
    p.add_argument(
        "--xtc-probability",
        type=float,
        default=0.0,
        metavar="P",
        help="XTC: with probability P per token, drop the likeliest tokens above "
        "--xtc-threshold but the least of them (0 = off)",
    )
    p.add_argument(
        "--xtc-threshold", type=float, default=0.1, metavar="T", help="XTC's threshold (0.1)"
    )
    p.add_argument(
        "--mirostat",
        type=int,
        default=0,
        choices=(0, 2),
        help="2: Mirostat v2, which steers each token's surprise toward --mirostat-tau (0 = off)",
    )
    p.add_argument(
        "--mirostat-tau", type=float, default=5.0, metavar="TAU", help="target surprise, bits"
    )
    p.add_argument(
        "--mirostat-eta", type=float, default=0.1, metavar="ETA", help="Mirostat's learning rate"
    )
    p.add_argument(
        "--dry-multiplier",
        type=float,
        default=0.0,
        metavar="M",
        help="DRY: penalise tokens that would extend a repeat of the context by "
        "M * base ** (run - allowed length) (0 = off)",
    )
    p.add_argument("--dry-base", type=float, default=1.75, metavar="B", help="DRY's base (1.75)")
    p.add_argument(
        "--dry-allowed-length",
        type=int,
        default=2,
        metavar="N",
        help="DRY: repeats up to N tokens go unpenalised (2)",
    )
    p.add_argument(
        "--dry-penalty-last-n",
        type=int,
        default=-1,
        metavar="N",
        help="DRY looks at the last N tokens of the context (-1 = all, 0 = off)",
    )
    p.add_argument(
        "--dry-sequence-breaker",
        action="append",
        metavar="TEXT",
        help="a string no DRY repeat reaches back across; repeat the flag for several "
        "(default: newline, ':', '\"', '*'; 'none' for none)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="divide the logits of tokens already seen by this (1 = off)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=seed,
        metavar="S",
        help="random seed (default: a fresh one each run)"
        if seed is None
        else "random seed; fixed, so that two runs draw the same tokens",
    )
    p.add_argument(
        "--stop", action="append", default=None, metavar="STR", help="stop string (repeatable)"
    )
    c = p.add_argument_group(
        "structured output", "constrain the answer, token by token (at most one of these)"
    )
    c.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="answer with JSON valid against the JSON Schema in FILE",
    )
    c.add_argument(
        "--regex", default=None, metavar="RE", help="answer with text matching this regex"
    )
    c.add_argument(
        "--choice",
        action="append",
        default=None,
        metavar="STR",
        help="answer with exactly one of these strings (repeatable)",
    )
    c.add_argument(
        "--grammar",
        default=None,
        metavar="FILE",
        help="answer with a sentence of the grammar in FILE (Lark or llama.cpp's GBNF)",
    )


def _read_option_file(field: str, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ParamError.named(field, f" cannot read {path}: {reason}") from None


def _params(args: argparse.Namespace):
    from tokenmill.sampling.params import SamplingParams  # torch-free

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        typical_p=args.typical_p,
        top_n_sigma=args.top_n_sigma,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        mirostat=args.mirostat,
        mirostat_tau=args.mirostat_tau,
        mirostat_eta=args.mirostat_eta,
        dry_multiplier=args.dry_multiplier,
        dry_base=args.dry_base,
        dry_allowed_length=args.dry_allowed_length,
        dry_penalty_last_n=args.dry_penalty_last_n,
        dry_sequence_breakers=(
            [] if args.dry_sequence_breaker == ["none"] else args.dry_sequence_breaker
        ),
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        json_schema=_read_option_file("json_schema", args.json_schema),
        regex=args.regex,
        choice=args.choice,
        grammar=_read_option_file("grammar", args.grammar),
    )


# ---------------------------------------------------------------------- checks before loading


# The GPUs the engine runs on (anything but the CPU runs torch's own ops); torch knows
# more device types (meta, ipu, hpu...), none of which tokenmill can use.
GPU_DEVICES = ("cuda", "mps", "xpu")
TORCH_BUILDS = "https://pytorch.org/get-started/locally/"


def check_device(text: str) -> str:
    """`text` ("cpu", "cuda", "cuda:1", "mps", "xpu") if this torch build can run on that
    device, as the engine compares it ("cpu:0" is "cpu": torch has one CPU device); else
    ArgumentError. Imports torch only for a device other than the CPU."""
    kind, colon, index = text.partition(":")
    supported = "cpu, cuda[:N] (NVIDIA or AMD GPUs), mps (Apple GPUs) or xpu (Intel GPUs)"
    if kind in ("tpu", "xla"):
        raise ArgumentError(
            "--device",
            f"{text!r}: TPUs are torch_xla's 'xla' device, which tokenmill does not run on "
            f"(it runs on {supported})",
        )
    if kind not in ("cpu", *GPU_DEVICES) or (colon and not index.isdigit()):
        raise ArgumentError("--device", f"tokenmill cannot run on {text!r}; it runs on {supported}")
    if kind == "cpu":
        return "cpu"
    import torch

    build = f"this torch ({torch.__version__})"
    count = 1
    if kind == "cuda":
        if not torch.backends.cuda.is_built():
            raise ArgumentError(
                "--device",
                f"{build} is built without CUDA; {text} needs a CUDA build of torch "
                f"(NVIDIA GPUs) or a ROCm build (AMD GPUs): {TORCH_BUILDS}",
            )
        count = torch.cuda.device_count()
        if count == 0:
            raise ArgumentError(
                "--device",
                f"{build} has CUDA but finds no GPU: check the driver (nvidia-smi or "
                "rocm-smi) and CUDA_VISIBLE_DEVICES",
            )
    elif kind == "mps":
        if not torch.backends.mps.is_built():
            raise ArgumentError(
                "--device",
                f"{build} is built without MPS; mps (Apple GPUs) needs torch's macOS build "
                "on Apple silicon",
            )
        if not torch.backends.mps.is_available():
            raise ArgumentError(
                "--device", "MPS is built into this torch but unavailable: it needs macOS 12.3+"
            )
    else:  # xpu
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu._is_compiled():
            raise ArgumentError(
                "--device",
                f"{build} is built without XPU; xpu (Intel GPUs) needs an XPU build of torch: "
                f"{TORCH_BUILDS}",
            )
        count = xpu.device_count()
        if count == 0:
            raise ArgumentError("--device", f"{build} has XPU but finds no Intel GPU")
    if index and int(index) >= count:
        raise ArgumentError(
            "--device",
            f"{text} does not exist: this machine has {count} {kind} device(s), "
            f"{kind}:0 to {kind}:{count - 1}",
        )
    return text


def check_output_path(option: str, path: str | None) -> None:
    """Raise ArgumentError now for an output file that could not be written when the run
    ends: a missing or read-only folder, or a folder where the file should be."""
    if path is None:
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ArgumentError(option, f"{path} is a folder; give a file name")
    if not folder.is_dir():
        raise ArgumentError(option, f"cannot write {path}: folder {folder} does not exist")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ArgumentError(option, f"cannot write {path}: permission denied")


@dataclass
class ModelFacts:
    """What the checks before loading know about the model: its config from the file's
    header, the context a request gets, and its tokenizer (read on first use: a fraction
    of a second, against seconds for the weights)."""

    path: Path
    name: str
    config: Any  # tokenmill.config.ModelConfig
    max_model_len: int  # what LLMEngine.max_model_len will be
    _tokenizer: Any = field(default=None, repr=False)

    def tokenizer(self):
        if self._tokenizer is None:
            from tokenmill.engine.llm_engine import load_tokenizer

            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


def model_facts(args: argparse.Namespace) -> ModelFacts:
    """Open the checkpoint's header (no weights) and work out the context a request will
    get, as LLMEngine does: min(the model's positions, the KV pool's tokens). Raises
    LoadError for a file that cannot load, ArgumentError for a KV pool larger than the
    machine's memory (the check KVCache makes once the weights are in)."""
    import torch

    from tokenmill.dtypes import DTYPES
    from tokenmill.engine.build import kv_cache_torch_dtype
    from tokenmill.engine.kv_cache import BLOCK_SIZE, check_pool_fits, kv_blocks, kv_bytes_per_token
    from tokenmill.loader import open_checkpoint

    config = open_checkpoint(args.model_path).config
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    try:  # the engine's own checks: a known name, a head_dim q8_0 can cut into blocks
        kv_dtype = kv_cache_torch_dtype(getattr(args, "kv_cache_dtype", "auto"), dtype)
        per_token = kv_bytes_per_token(config, kv_dtype)
    except ParamError as e:
        raise ArgumentError("--kv-cache-dtype", e.problem or str(e)) from None
    # the CLI never sets block_size: the engine's default is the one it will use
    tokens = kv_blocks(config, BLOCK_SIZE, kv_dtype, device, args.kv_cache_memory) * BLOCK_SIZE
    try:
        check_pool_fits(tokens, per_token, device, args.kv_cache_memory)
    except ParamError as e:
        raise ArgumentError("--kv-cache-memory", e.problem) from None
    name = hub.display_name(args.model)
    return ModelFacts(args.model_path, name, config, min(config.max_position, tokens))


def check_parallel(args: argparse.Namespace, facts: ModelFacts) -> None:
    """The parallel plan, worked out from the config as the ranks will (distributed/plan.py),
    before any rank starts: a plan that cannot work fails in every rank otherwise."""
    from tokenmill.distributed.plan import PlanError, pp_plan, tp_plan

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if tp == 1 and pp == 1:
        return
    if tp > 1 and pp > 1:
        raise ArgumentError(
            "--pipeline-parallel-size", "use tensor or pipeline parallelism, not both in one run"
        )
    if args.device != "cpu":
        raise ArgumentError("--device", "parallel runs use the CPU (gloo); use --device cpu")
    option, plan, size = (
        ("--tensor-parallel-size", tp_plan, tp) if tp > 1 else
        ("--pipeline-parallel-size", pp_plan, pp)
    )  # fmt: skip
    try:
        plan(facts.config, size)
    except PlanError as e:
        raise ArgumentError(option, f"{facts.name}: {e}") from None


# Tokens the tokenizer may add around a prompt's text (BOS, EOS, SentencePiece's prefix
# space): a text of n characters, each token covering at least one, is at most n + this.
ADDED_TOKENS = 4


def check_prompt(args: argparse.Namespace, facts: ModelFacts) -> None:
    """PROMPT (as given, or through the chat template with --chat) must be non-empty and fit
    the context with room for one generated token, as LLMEngine.add_request requires. The
    tokenizer is read only when the text's length alone cannot settle it."""
    from tokenmill.tokenizer.tokenizer import TextTooLong

    limit = facts.max_model_len
    if not args.chat and args.prompt and len(args.prompt) + ADDED_TOKENS < limit:
        return
    tokenizer = facts.tokenizer()
    try:
        if args.chat:
            if tokenizer.chat_template is None:
                raise ArgumentError(
                    "--chat", f"{facts.name} has no chat template; without --chat the text is "
                    "continued as it is"
                )  # fmt: skip
            messages = [{"role": "user", "content": args.prompt}]
            ids = tokenizer.encode_chat(messages, max_tokens=limit)
        else:
            ids = tokenizer.encode(args.prompt, add_special_tokens=True, max_tokens=limit)
    except TextTooLong as e:
        raise ArgumentError(
            "PROMPT",
            f"has {e.num_bytes} bytes of text, at least {e.min_tokens} tokens: more than the "
            f"context of {limit - 1} (leaving room for one generated token)",
        ) from None
    if not ids:
        raise ArgumentError("PROMPT", "is empty (and this model adds no BOS token to it)")
    if len(ids) >= limit:
        raise ArgumentError(
            "PROMPT",
            f"has {len(ids)} tokens, more than the context of {limit - 1} (leaving room for "
            "one generated token)",
        )


# SamplingParams' constraint fields and the options that set them
CONSTRAINT_OPTIONS = {
    "json_schema": "--json-schema",
    "regex": "--regex",
    "choice": "--choice",
    "grammar": "--grammar",
}


def check_constraint(args: argparse.Namespace, facts: ModelFacts) -> None:
    """Compile the structured-output constraint now, with the grammar compiler the engine
    uses, against the model's tokenizer: a regex, schema or grammar it refuses fails
    before the weights load. The compiler, its vocabulary view and the compiled grammar
    are handed to the engine (load_llm), so the work is not done twice."""
    params = _params(args)
    constraint = params.constraint
    if constraint is None:
        return
    from tokenmill.engine.llm_engine import model_eos_ids
    from tokenmill.sampling.grammar import GrammarCompiler, GrammarError

    tokenizer = facts.tokenizer()
    eos = model_eos_ids(tokenizer, facts.config)
    compiler = GrammarCompiler(tokenizer, facts.config.vocab_size, eos)
    try:
        compiler.compile(*constraint)
    except GrammarError as e:
        raise ArgumentError(CONSTRAINT_OPTIONS.get(e.kind, f"--{e.kind}"), str(e)) from None
    args.grammar_compiler = compiler


def check_before_loading(args: argparse.Namespace) -> None:
    """Every check that needs the machine or the model but not its weights (see the module's
    docstring), in the order that answers cheapest first. Commands add their own: `check`
    (no model needed: the server's address) and `check_model` (given ModelFacts)."""
    if hasattr(args, "device"):
        args.device = check_device(args.device)
        if args.quantization not in ("auto", "none") and args.device != "cpu":
            raise ArgumentError(
                "--quantization",
                f"{args.quantization} weights run on the CPU kernels only; with --device "
                f"{args.device} use auto or none",
            )
    for option in ("json", "plot"):  # written when a long run ends: checked before it starts
        check_output_path(f"--{option}", getattr(args, option, None))
    if (check := getattr(args, "check", None)) is not None:
        check(args)
    if not hasattr(args, "model"):
        return
    args.model_path = prepare_model(args)
    facts = model_facts(args)
    check_parallel(args, facts)
    if hasattr(args, "prompt"):
        check_prompt(args, facts)
    if hasattr(args, "max_tokens"):
        check_constraint(args, facts)
    if (check_model := getattr(args, "check_model", None)) is not None:
        check_model(args, facts)


# ---------------------------------------------------------------------- loading


def prepare_model(args: argparse.Namespace) -> Path:
    """Resolve --model to a path (fetching a known model on first use) and check that it
    looks like a checkpoint, without importing torch. Raises LoadError / FetchError."""
    from tokenmill.loader import sniff_format

    path = hub.resolve_model(args.model)
    sniff_format(path)
    return path


def load_llm(args: argparse.Namespace, **engine_kwargs: Any):
    """Load the model, with a progress bar on stderr when stderr is a terminal."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tokenmill.llm import LLM

    path = getattr(args, "model_path", None) or prepare_model(args)
    if (speculative := speculative_option(args)) is not None:
        engine_kwargs.setdefault("speculative", speculative)
    if (kv_cache_dtype := getattr(args, "kv_cache_dtype", None)) is not None:
        engine_kwargs.setdefault("kv_cache_dtype", kv_cache_dtype)
    if (activation_bits := getattr(args, "activation_bits", None)) is not None:
        engine_kwargs.setdefault("activation_bits", activation_bits)
    console = stderr_console()
    with Progress(
        TextColumn("loading {task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        transient=True,
        console=console,
        # off a terminal a transient bar has nothing to erase and leaves a blank line
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(path.name, total=None, count="")  # the total comes with the first tick

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, count=f"{done}/{total} tensors")

        llm = LLM(
            path,
            dtype=args.dtype,
            device=args.device,
            threads=args.threads,
            kv_cache_memory=args.kv_cache_memory,
            quantization=args.quantization,
            progress=tick,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            **engine_kwargs,
        )
    engine = llm.engine
    if (compiler := getattr(args, "grammar_compiler", None)) is not None:
        # check_constraint's, for this model's vocabulary and EOS ids: the grammar is in
        # its cache already
        engine.grammars = compiler
    console.print(engine.describe(), style="dim", soft_wrap=True, highlight=False)
    return llm


def stderr_console():
    from rich.console import Console

    # markup off: what it prints (help text like "/think [on|off]", a model's thinking,
    # engine descriptions) is plain text, and rich would eat "[...]" as style tags
    return Console(stderr=True, markup=False)
