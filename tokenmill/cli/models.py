"""`tokenmill pull`, `tokenmill list` and `tokenmill rm`: models by name from the Hugging
Face Hub, in huggingface_hub's cache (tokenmill/hf.py), as `ollama pull/list/rm` and
`huggingface-cli download/scan-cache/delete-cache` keep theirs.

    tokenmill pull hf:ORG/REPO[:QUANT]   fetch a GGUF file (or a safetensors repository,
                                         ORG/REPO) into the cache; prints its path
    tokenmill list                       the repositories in the cache, with their sizes
    tokenmill rm ORG/REPO                delete one from the cache

Every other command takes the same names for --model, fetching on first use.
"""

from __future__ import annotations

import argparse

from tokenmill.hub import FetchError


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "pull",
        help="fetch a model from the Hugging Face Hub into the cache",
        description="Fetch hf:ORG/REPO[:QUANT] (a GGUF file of that quant type, Q4_K_M by "
        "default; split files all) or ORG/REPO (a safetensors repository) into "
        "huggingface_hub's cache, and print the path to load. HF_TOKEN, HF_ENDPOINT and "
        "HF_HUB_OFFLINE apply.",
    )
    p.add_argument("name", help="hf:ORG/REPO[:QUANT], hf:ORG/REPO:FILE.gguf or ORG/REPO")
    p.set_defaults(func=cmd_pull)
    p = subparsers.add_parser(
        "list",
        aliases=["ls"],
        help="list the models in the Hugging Face cache",
        description="List the model repositories in huggingface_hub's cache, with their "
        "size on disk and files.",
    )
    p.set_defaults(func=cmd_list)
    p = subparsers.add_parser(
        "rm",
        help="delete a model from the Hugging Face cache",
        description="Delete a model repository (every revision) from huggingface_hub's cache.",
    )
    p.add_argument("name", help="ORG/REPO (hf: in front, or a :QUANT tag, are accepted)")
    p.set_defaults(func=cmd_rm)


def cmd_pull(args: argparse.Namespace) -> None:
    from tokenmill import hf

    try:
        print(hf.resolve(args.name))
    except hf.HubError as e:
        raise FetchError(str(e)) from None


def cmd_list(args: argparse.Namespace) -> None:
    from tokenmill import hf

    repos = hf.cached()
    if not repos:
        print("no models in the Hugging Face cache")
        return
    width = max(len(r.repo) for r in repos)
    for r in repos:
        files = ", ".join(f for f in r.files if f.endswith((".gguf", ".safetensors"))) or "-"
        print(f"{r.repo:<{width}}  {_size(r.size):>9}  {files}")


def cmd_rm(args: argparse.Namespace) -> None:
    from tokenmill import hf

    try:
        freed = hf.remove(args.name)
    except hf.HubError as e:
        raise FetchError(str(e)) from None
    print(f"deleted {hf.parse(args.name).repo} ({_size(freed)})")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
