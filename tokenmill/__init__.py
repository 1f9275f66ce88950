"""tokenmill: an LLM inference engine in Python that runs real models and shows its work.

The public names are imported on first use (PEP 562), not here: `import tokenmill`
must stay free of torch, so that `tokenmill --help` and argument errors answer at
once, and so that `python -m tokenmill.hub` does not find its own module already
imported by this package (runpy's RuntimeWarning).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenmill.version import __version__ as __version__  # re-exported

__all__ = ["LLM", "Completion", "Output", "SamplingParams"]

_EXPORTS = {
    "LLM": "tokenmill.llm",
    "Completion": "tokenmill.llm",
    "Output": "tokenmill.llm",
    "SamplingParams": "tokenmill.sampling.params",
}

if TYPE_CHECKING:  # for type checkers and editors; never executed
    from tokenmill.llm import LLM, Completion, Output
    from tokenmill.sampling.params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
