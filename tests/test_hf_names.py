"""Models by name from the Hugging Face Hub (tokenmill/hf.py, `tokenmill pull/list/rm`),
against a stand-in Hub on 127.0.0.1 (tests/hub_server.py) through huggingface_hub itself:
quant tags pick their file (Q4_K_M by default, one name matching several files refused),
split GGUFs load whole, a safetensors repository loads as its folder, a dropped download
resumes, a wrong checksum is refused and removed, offline mode reads the cache, and a
name that resolves nowhere is one line saying what was tried."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q
from helpers import build_hf_model, write_llama_gguf
from hub_server import FakeHub, serving

from tokenmill import LLM, hf
from tokenmill.loader import LoadError
from tokenmill.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [1, 5, 6, 7]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama as one Q8_0 GGUF, as the same model split in three parts, and as a
    safetensors folder."""
    root = tmp_path_factory.mktemp("hub-files")
    model = build_hf_model("llama", root / "folder")
    write_llama_gguf(model, root / "tiny-Q8_0.gguf", Q.Q8_0)
    write_llama_gguf(build_hf_model("llama", root / "again"), root / "split.gguf", Q.Q8_0,
                     split_max_tensors=10)  # fmt: skip
    return root


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    parts = sorted(files.glob("split-0000*-of-00003.gguf"))
    hub = FakeHub(
        {
            "org/tiny-GGUF": {
                "tiny-Q8_0.gguf": files / "tiny-Q8_0.gguf",
                "tiny-Q4_K_M.gguf": files / "tiny-Q8_0.gguf",  # a stand-in for the default
                "tiny-Q4_K_M_L.gguf": files / "tiny-Q8_0.gguf",  # Q4_K_M must not match it
                "sub/other-Q5_K_S.gguf": files / "tiny-Q8_0.gguf",
                "other-Q5_K_S.gguf": files / "tiny-Q8_0.gguf",
                "mmproj-tiny-Q8_0.gguf": b"not a language model",
                "README.md": b"# tiny",
            },
            "org/split-GGUF": {
                f"Q8_0/tiny-Q8_0-{i + 1:05d}-of-00003.gguf": p for i, p in enumerate(parts)
            },
            "org/tiny": {p.name: p for p in (files / "folder").iterdir() if p.is_file()},
            "org/big-GGUF": {"big-Q8_0.gguf": os.urandom(24 << 20)},
        }
    )
    with serving(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        hub.url = url
        yield hub


def greedy(model) -> list[int]:
    llm = LLM(str(model), kv_cache_memory="512tok", threads=1)
    try:
        return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    finally:
        llm.close()


def test_quant_tags_pick_their_file(hub):
    assert hf.resolve("hf:org/tiny-GGUF", quiet=True).name == "tiny-Q4_K_M.gguf"  # default
    assert hf.resolve("hf:org/tiny-GGUF:q8_0", quiet=True).name == "tiny-Q8_0.gguf"
    assert hf.resolve("org/tiny-GGUF:tiny-Q4_K_M_L.gguf", quiet=True).name == "tiny-Q4_K_M_L.gguf"
    with pytest.raises(hf.HubError, match=r"matches several files .*other-Q5_K_S.gguf"):
        hf.resolve("hf:org/tiny-GGUF:Q5_K_S", quiet=True)
    with pytest.raises(hf.HubError, match=r"no GGUF file of quant 'IQ2_XS' \(its files: "):
        hf.resolve("hf:org/tiny-GGUF:IQ2_XS", quiet=True)
    with pytest.raises(hf.HubError, match="answered 404"):
        hf.resolve("hf:org/missing", quiet=True)
    fetched = {path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path}
    assert not any("mmproj" in p or "README" in p or "Q5_K_S" in p for p in fetched)


def test_a_gguf_by_name_generates_as_the_file(hub, files):
    assert greedy("hf:org/tiny-GGUF:Q8_0") == greedy(files / "tiny-Q8_0.gguf")


def test_split_gguf_loads_whole(hub, files):
    first = hf.resolve("hf:org/split-GGUF:Q8_0", quiet=True)
    assert first.name == "tiny-Q8_0-00001-of-00003.gguf"
    assert sorted(p.name for p in first.parent.iterdir()) == [
        f"tiny-Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)
    ]
    assert greedy("hf:org/split-GGUF:Q8_0") == greedy(files / "tiny-Q8_0.gguf")
    # a part gone from beside the first: one line naming it
    (first.parent / "tiny-Q8_0-00003-of-00003.gguf").unlink()
    with pytest.raises(LoadError, match="part 3 of 3 is missing"):
        greedy(first)


def test_a_safetensors_repo_loads_as_its_folder(hub, files):
    folder = hf.resolve("org/tiny", quiet=True)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert greedy("org/tiny") == greedy(files / "folder")


def test_a_dropped_download_resumes(hub):
    hub.cut_once["big-Q8_0.gguf"] = 15 << 20
    path = hf.resolve("hf:org/big-GGUF", quiet=True)
    assert path.read_bytes() == hub.repos["org/big-GGUF"]["big-Q8_0.gguf"]
    ranges = [r for method, p, r in hub.requests if method == "GET" and "big-Q8_0" in p]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=")


def test_a_wrong_checksum_is_refused_and_removed(hub):
    hub.wrong_sha.add("tiny-Q8_0.gguf")
    with pytest.raises(hf.HubError, match="has SHA-256 .* not the .* the download was removed"):
        hf.resolve("hf:org/tiny-GGUF:Q8_0", quiet=True)
    assert all("tiny-Q8_0.gguf" not in r.files for r in hf.cached())


def test_offline_reads_the_cache(hub, monkeypatch):
    path = hf.resolve("hf:org/tiny-GGUF:Q8_0", quiet=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    count = len(hub.requests)
    assert hf.resolve("hf:org/tiny-GGUF:Q8_0", quiet=True) == path
    assert len(hub.requests) == count  # not one request
    with pytest.raises(hf.HubError, match="no GGUF file of quant 'Q4_K_M'.* offline"):
        hf.resolve("hf:org/tiny-GGUF:Q4_K_M", quiet=True)
    with pytest.raises(hf.HubError, match="org/tiny is not in the cache"):
        hf.resolve("org/tiny", quiet=True)


def test_an_unresolvable_name_says_what_was_tried(hub):
    with pytest.raises(LoadError) as e:
        greedy("hf:org/missing:Q4_K_M")
    message = str(e.value)
    assert "not a known model name" in message and "answered 404" in message
    assert "\n" not in message


def test_pull_list_rm(hub):
    env = {**os.environ}
    run = [sys.executable, "-m", "tokenmill.cli"]
    out = subprocess.run([*run, "pull", "hf:org/tiny-GGUF:Q8_0"], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("tiny-Q8_0.gguf")
    listed = subprocess.run([*run, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert "org/tiny-GGUF" in listed.stdout and "tiny-Q8_0.gguf" in listed.stdout
    gone = subprocess.run([*run, "rm", "org/tiny-GGUF"], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert gone.returncode == 0 and "deleted org/tiny-GGUF" in gone.stdout
    listed = subprocess.run([*run, "list"], env=env, capture_output=True, text=True, timeout=60)
    assert "org/tiny-GGUF" not in listed.stdout
    bad = subprocess.run([*run, "pull", "hf:org/missing"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "404" in bad.stderr
