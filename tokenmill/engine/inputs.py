"""A request's prompt as the engine takes it: token ids checked against the model.

    encode_prompt(tokenizer, prompt, max_model_len, vocab_size)
        text -> ids (refused before tokenizing when it cannot fit), or ids checked
        against the vocabulary; RequestError(param="prompt") names what is wrong.
    too_long(e, max_model_len)
        the one wording for a text over the context (prompts, and LLMEngine.encode_chat).

LLMEngine.encode_prompt is this with the engine's tokenizer and limits.
"""

from __future__ import annotations

from tokenmill.checks import ParamError
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.tokenizer import TextTooLong


class RequestError(ParamError):
    """A request the engine cannot take (bad prompt, too long, duplicate id...); `param`
    names the input it is about ("prompt"), or the sampling parameter the request's
    grammar or sampler refused."""


def too_long(e: TextTooLong, max_model_len: int) -> str:
    """Why a text cannot be a prompt for a context of max_model_len positions."""
    return (
        f"prompt has {e.num_bytes} bytes of text, at least {e.min_tokens} tokens: more "
        f"than the model's context of {max_model_len - 1} "
        "(leaving room for at least one generated token)"
    )


def encode_prompt(
    tokenizer: Tokenizer, prompt: str | list[int], max_model_len: int, vocab_size: int
) -> list[int]:
    """Token ids of a prompt (text, or ids checked against the vocabulary). A text that
    cannot fit in the context is refused before it is tokenized."""
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=True, max_tokens=max_model_len)
        except TextTooLong as e:
            raise RequestError(too_long(e, max_model_len), "prompt") from None
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]} is out of range [0, {vocab_size})", "prompt"
            )
    else:
        raise RequestError("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise RequestError("prompt is empty", "prompt")
    return ids
