"""Models by name from the Hugging Face Hub, through huggingface_hub: its cache folder
(shared with every other HF tool), its downloads (resumed when a connection drops), its
token (HF_TOKEN, for gated repositories), HF_ENDPOINT and HF_HUB_OFFLINE, and a progress
bar on a terminal.

    hf:ORG/REPO[:QUANT]     a GGUF repository: the file of that quant type (Q4_K_M when
                            none is named, as llama.cpp picks), split files all fetched
                            and loaded together; e.g. hf:bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M
    hf:ORG/REPO:FILE.gguf   one GGUF file of a repository, by its name
    ORG/REPO                a safetensors repository: config, tokenizer and weights (vLLM's
                            way to name a model); hf: in front says the same

A quant tag matches a file name where it stands between separators (Q4_K does not match
Q4_K_M). Each file that is downloaded is checked against the SHA-256 the Hub lists for it;
a mismatch removes it and fails. Offline (HF_HUB_OFFLINE=1) a name resolves from the
cache alone.

    is_hub_name(text)   whether a --model value names a Hub repository
    resolve(text)       the local path to load (fetching what is missing): pull
    cached()            the repositories in the cache (tokenmill list)
    remove(text)        delete a repository from the cache (tokenmill rm)

The settings are read when a function runs, not when huggingface_hub is imported, so a
test (or a long-lived process) may point them elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path


class HubError(RuntimeError):
    """A Hub name that cannot be resolved, fetched or removed: one line saying why."""


DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's pick when a GGUF repository is named without a tag
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# What a safetensors repository needs to load (weights, config, tokenizer, templates,
# sentence-transformers' pooling); other formats' weights (.bin, .onnx, .gguf) are left
_FOLDER_FILES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json"
    r"|special_tokens_map\.json|chat_template\.(jinja|json)|modules\.json"
    r"|[^/]*\.safetensors|[^/]*\.safetensors\.index\.json|1_Pooling/config\.json)$"
)


@dataclass(frozen=True)
class HubName:
    repo: str  # ORG/REPO
    tag: str | None  # a quant type or a .gguf file name; None: the default

    @property
    def display(self) -> str:
        return self.repo if self.tag is None else f"{self.repo}:{self.tag}"


def is_hub_name(text: str) -> bool:
    """hf:ORG/REPO[:TAG], or ORG/REPO[:TAG] (the caller has checked it is no local path)."""
    return parse(text) is not None


def parse(text: str) -> HubName | None:
    body = text[3:] if text.startswith("hf:") else text
    repo, _, tag = body.partition(":")
    if not _REPO.match(repo) or ".." in repo:
        return None
    return HubName(repo, tag or None)


# --------------------------------------------------------------------------- settings


def _settings() -> dict:
    """huggingface_hub's settings as the environment says now."""
    from huggingface_hub import constants

    home = os.environ.get("HF_HOME")
    cache = os.environ.get("HF_HUB_CACHE") or (
        str(Path(home) / "hub") if home else constants.HF_HUB_CACHE
    )
    return {
        "endpoint": os.environ.get("HF_ENDPOINT") or constants.ENDPOINT,
        "cache_dir": cache,
        "token": os.environ.get("HF_TOKEN") or None,
        "offline": os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"),
    }


# --------------------------------------------------------------------------- resolve


def resolve(text: str, quiet: bool = False) -> Path:
    """The local path of a Hub name's model, downloading what the cache lacks: a .gguf
    file (the first part of a split one) or a snapshot folder. HubError naming the
    repository and what went wrong."""
    name = parse(text)
    if name is None:
        raise HubError(f"{text!r} is not a Hub name (hf:ORG/REPO[:QUANT] or ORG/REPO)")
    s = _settings()
    commit, listing = _listing(name.repo, s)
    ggufs = sorted(f for f in listing if f.endswith(".gguf") and "mmproj" not in f.lower())
    if ggufs or (name.tag and name.tag.endswith(".gguf")):
        try:
            files = _pick_gguf(name, ggufs)
        except HubError as e:
            if not s["offline"]:
                raise
            raise HubError(f"{e}; offline (HF_HUB_OFFLINE), only the cache's files count") from None
    else:
        if name.tag is not None:
            raise HubError(f"{name.repo} has no GGUF files, so no quant {name.tag!r}")
        files = [f for f in listing if _FOLDER_FILES.match(f)]
        if "config.json" not in files:
            raise HubError(f"{name.repo} has neither GGUF files nor a config.json to load")
    paths = [_download(name.repo, commit, f, listing.get(f), s, quiet) for f in files]
    if not s["offline"]:  # main is this commit now, as huggingface_hub records a branch
        ref = _repo_folder(name.repo, s) / "refs" / "main"
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return paths[0] if files[0].endswith(".gguf") else paths[0].parent


def _listing(repo: str, s: dict) -> tuple[str, dict[str, str | None]]:
    """(commit, {file: its SHA-256 when the Hub lists one}) of the repository's main
    revision; offline, from the cache's snapshot."""
    if s["offline"]:
        return _cached_listing(repo, s)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi(endpoint=s["endpoint"], token=s["token"]).model_info(repo, files_metadata=True)
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "no answer"
        raise HubError(f"{repo}: the Hub at {s['endpoint']} answered {status}") from None
    except OSError as e:  # no connection: the cache may still have it
        try:
            return _cached_listing(repo, s)
        except HubError:
            raise HubError(f"{repo}: cannot reach {s['endpoint']} ({e})") from None
    files = {
        f.rfilename: (f.lfs.sha256 if f.lfs is not None else None) for f in info.siblings or []
    }
    return info.sha, files


def _repo_folder(repo: str, s: dict) -> Path:
    return Path(s["cache_dir"]) / ("models--" + repo.replace("/", "--"))


def _cached_listing(repo: str, s: dict) -> tuple[str, dict[str, str | None]]:
    folder = _repo_folder(repo, s)
    ref = folder / "refs" / "main"
    if not ref.is_file():
        raise HubError(f"{repo} is not in the cache {s['cache_dir']} (offline: HF_HUB_OFFLINE)")
    commit = ref.read_text().strip()
    snapshot = folder / "snapshots" / commit
    files = {str(p.relative_to(snapshot)): None for p in snapshot.rglob("*") if p.is_file()}
    return commit, files


def _pick_gguf(name: HubName, ggufs: list[str]) -> list[str]:
    """The GGUF file (all parts of a split one, in order) a name's tag picks."""
    tag = name.tag
    if tag is not None and tag.endswith(".gguf"):
        found = [f for f in ggufs if f == tag or f.rsplit("/", 1)[-1] == tag]
        if not found:
            raise HubError(f"{name.repo} has no file {tag!r} (its GGUF files: {_few(ggufs)})")
        matches = found
    else:
        want = tag or DEFAULT_QUANT
        pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(want)}(?![A-Za-z0-9_])", re.I)
        matches = [f for f in ggufs if pattern.search(f.rsplit("/", 1)[-1])]
        if not matches and tag is None and len(ggufs) == 1:
            matches = ggufs  # one file: that one, whatever its type
        if not matches:
            raise HubError(
                f"{name.repo} has no GGUF file of quant {want!r} (its files: {_few(ggufs)})"
            )
    groups: dict[str, list[str]] = {}
    for f in matches:
        groups.setdefault(_SPLIT.sub("", f), []).append(f)
    if len(groups) > 1:
        firsts = [parts[0] for parts in groups.values()]
        raise HubError(
            f"{name.display} matches several files ({_few(firsts)}): name one, as "
            f"hf:{name.repo}:FILE.gguf"
        )
    [parts] = groups.values()
    split = _SPLIT.search(parts[0])
    if split is not None and len(parts) != int(split.group(2)):
        raise HubError(
            f"{name.repo} lists {len(parts)} of the {split.group(2)} parts of {parts[0]}"
        )
    return sorted(parts)


def _few(files: list[str], n: int = 8) -> str:
    shown = ", ".join(files[:n])
    return shown + (f" and {len(files) - n} more" if len(files) > n else "") if files else "none"


def _download(
    repo: str, commit: str, filename: str, sha256: str | None, s: dict, quiet: bool
) -> Path:
    """One file of the repository, from the cache or downloaded (and then checked)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(repo, filename, cache_dir=s["cache_dir"], revision=commit)
    if isinstance(cached, str):
        return Path(cached)
    if s["offline"]:
        raise HubError(f"{repo}: {filename} is not in the cache (offline: HF_HUB_OFFLINE)")
    if not quiet:
        print(f"tokenmill: downloading {repo}/{filename}", file=sys.stderr)
    try:
        path = Path(
            hf_hub_download(
                repo,
                filename,
                revision=commit,
                cache_dir=s["cache_dir"],
                endpoint=s["endpoint"],
                token=s["token"],
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise HubError(f"{repo}: downloading {filename} failed: {e}") from None
    if sha256 is not None:
        got = _sha256(path)
        if got != sha256:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise HubError(
                f"{repo}: {filename} has SHA-256 {got}, not the {sha256} the Hub lists; "
                "the download was removed"
            )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class CachedRepo:
    repo: str
    size: int  # bytes on disk
    files: tuple[str, ...]  # of its newest snapshot
    path: Path


def cached() -> list[CachedRepo]:
    """The model repositories in the Hub cache, by name."""
    from huggingface_hub import scan_cache_dir

    root = Path(_settings()["cache_dir"])
    if not root.is_dir():
        return []
    repos = []
    for info in scan_cache_dir(root).repos:
        if info.repo_type != "model":
            continue
        revisions = sorted(info.revisions, key=lambda r: r.last_modified)
        files = tuple(sorted(f.file_name for f in revisions[-1].files)) if revisions else ()
        repos.append(CachedRepo(info.repo_id, info.size_on_disk, files, Path(info.repo_path)))
    return sorted(repos, key=lambda r: r.repo.lower())


def remove(text: str) -> int:
    """Delete a repository (every revision) from the Hub cache; the bytes freed."""
    name = parse(text)
    if name is None:
        raise HubError(f"{text!r} is not a Hub name (hf:ORG/REPO or ORG/REPO)")
    import shutil

    found = next((r for r in cached() if r.repo.lower() == name.repo.lower()), None)
    if found is None:
        raise HubError(f"{name.repo} is not in the cache {_settings()['cache_dir']}")
    shutil.rmtree(found.path)
    return found.size
