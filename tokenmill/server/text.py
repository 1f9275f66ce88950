"""The string type of request fields: any text but lone UTF-16 surrogates.

"\ud800" is valid JSON but not Unicode text (UTF-8 cannot spell it), so a field that
holds one is refused with a 400 naming the field, before it reaches the tokenizer, a
grammar or an error message. Shared by the request models of protocol.py, tools.py and
structured.py.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_SURROGATE = re.compile("[\ud800-\udfff]")


def no_surrogates(text: str) -> str:
    if _SURROGATE.search(text):
        raise ValueError(
            "contains a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode"
        )
    return text


Text = Annotated[str, AfterValidator(no_surrogates)]
