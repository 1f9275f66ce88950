"""The string type of request fields (any text but lone UTF-16 surrogates), and the base
of the strict request models.

"\ud800" is valid JSON but not Unicode text (UTF-8 cannot spell it), so a field that
holds one is refused with a 400 naming the field, before it reaches the tokenizer, a
grammar or an error message. Shared by the request models of protocol.py and
structured.py.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

_SURROGATE = re.compile("[\ud800-\udfff]")


def no_surrogates(text: str) -> str:
    if _SURROGATE.search(text):
        raise ValueError(
            "contains a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode"
        )
    return text


Text = Annotated[str, AfterValidator(no_surrogates)]


class StrictModel(BaseModel):
    """A request model in pydantic's strict mode (JSON types as OpenAI documents them: no
    "0.5" for a float) that refuses unknown fields; a field with an alias (`schema`,
    which would shadow a BaseModel method) takes its own name too."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
