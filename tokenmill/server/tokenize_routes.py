"""Token counting, shaped like vLLM's: POST /tokenize and POST /detokenize.

    /tokenize    {"prompt": text, "add_special_tokens": true}  or  {"messages": [...]}
                 -> {"tokens": [ids], "count": n, "max_model_len": m}
                 messages go through the chat preparation (LLMEngine.encode_chat), so the
                 ids are the ones /v1/chat/completions would run; the template writes
                 their special tokens, so add_special_tokens may not be true with them.
    /detokenize  {"tokens": [ids]} -> {"prompt": text}; an id outside the vocabulary: 400

Behind the API key like /v1 (create_app includes every router but ops' with it).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.errors import invalid, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.running import check_messages_fit, check_model, engine_of, off_loop
from tokenmill.server.text import StrictModel, Text
from tokenmill.tokenizer.tokenizer import TextTooLong

router = APIRouter()


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def _tokenize(engine: LLMEngine, body: TokenizeRequest) -> list[int]:
    """The request's token ids (on a worker thread: templates and long texts)."""
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        try:
            return engine.tokenizer.encode(
                body.prompt, add_special_tokens=special, max_tokens=engine.max_model_len
            )
        except TextTooLong as e:
            raise invalid(
                f"prompt has {e.num_bytes} bytes of text, at least {e.min_tokens} tokens: "
                f"more than the model's context of {engine.max_model_len}",
                "prompt",
            ) from None
    if body.add_special_tokens:
        raise invalid(
            "add_special_tokens cannot be true with messages: the chat template writes "
            "their special tokens",
            "add_special_tokens",
        )
    for i, message in enumerate(body.messages):
        message.check(i)
    messages = [message.as_template_input(i) for i, message in enumerate(body.messages)]
    check_messages_fit(engine, messages)
    try:
        return engine.encode_chat(messages)
    except ValueError as e:  # ChatTemplateError, RequestError (too long), a refused message
        raise to_api_error(e, param="messages") from None


@router.post("/tokenize")
async def tokenize(
    body: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))], request: Request
) -> dict:
    check_model(request, body.model)
    engine = engine_of(request).engine
    ids = await off_loop(request, _tokenize, engine, body)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}


@router.post("/detokenize")
async def detokenize(
    body: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))], request: Request
) -> dict:
    check_model(request, body.model)
    engine = engine_of(request).engine
    vocab = engine.config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} is out of range [0, {vocab})", "tokens")
    return {"prompt": await off_loop(request, engine.tokenizer.decode, body.tokens)}
