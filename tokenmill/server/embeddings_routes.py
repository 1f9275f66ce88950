"""OpenAI's embeddings API: POST /v1/embeddings.

    input            a string, a list of strings, a list of token ids, or a list of lists
                     of ids: one vector each, in order
    encoding_format  "float" (lists of numbers) or "base64" (little-endian float32 bytes)
    dimensions       Matryoshka: the first `dimensions` values, L2-renormalized
    model, user      the served model's name (or none); `user` is accepted and not used

Every input runs its prompt through the engine's prefill (batched with whatever else
runs, chunked when long) and is pooled as the model's folder says (engine/pooling.py);
nothing decodes, and each input's KV blocks are freed when its vector is taken.
Limits: at most MAX_INPUTS inputs, each within the model's context (a 400 naming
`input`); the body limit bounds the rest.
"""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from tokenmill.engine.llm_engine import LLMEngine, RequestError
from tokenmill.engine.pooling import truncate
from tokenmill.sampling import SamplingParams
from tokenmill.server.async_engine import QueueFull, RequestStream, ShuttingDown
from tokenmill.server.errors import invalid, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.metrics import CLIENT_CLOSED_REQUEST
from tokenmill.server.running import (
    cache_salt_for,
    check_model,
    engine_of,
    off_loop,
    unless_disconnected,
)
from tokenmill.server.text import StrictModel, Text
from tokenmill.tokenizer.tokenizer import TextTooLong

router = APIRouter()

MAX_INPUTS = 2048  # inputs in one request, OpenAI's own limit


class EmbeddingRequest(StrictModel):
    input: Text | list[Text] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def encode_inputs(engine: LLMEngine, inputs: str | list) -> list[list[int]]:
    """Token ids of each input (texts tokenized with the model's special tokens, as an
    embedding model was trained), each checked against the context and the vocabulary.
    Runs on a worker thread."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise invalid("input is empty: give a string, a list of strings or token ids", "input")
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"input has {len(inputs)} items, more than {MAX_INPUTS}", "input")
    limit, vocab = engine.max_model_len, engine.config.vocab_size
    prompts = []
    for i, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            try:
                ids = engine.tokenizer.encode(item, add_special_tokens=True, max_tokens=limit)
            except TextTooLong as e:
                raise invalid(
                    f"{where} has {e.num_bytes} bytes of text, at least {e.min_tokens} "
                    f"tokens: more than the model's context of {limit}",
                    "input",
                ) from None
        else:
            ids = list(item)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"{where}: token id {bad} is out of range [0, {vocab})", "input")
        if not ids:
            raise invalid(f"{where} is empty", "input")
        if len(ids) > limit:
            raise invalid(
                f"{where} has {len(ids)} tokens, more than the model's context of {limit}",
                "input",
            )
        prompts.append(ids)
    return prompts


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


@router.post("/v1/embeddings")
async def create_embeddings(
    body: Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))], request: Request
) -> Response:
    engine = engine_of(request)
    model = check_model(request, body.model)
    size = engine.engine.config.hidden_size
    if body.dimensions is not None and body.dimensions > size:
        raise invalid(
            f"dimensions is {body.dimensions}, more than the model's {size}", "dimensions"
        )
    prompts = await off_loop(request, encode_inputs, engine.engine, body.input)
    vectors = await embed_prompts(request, prompts, EmbeddingRequest.model_fields)
    if vectors is None:  # the client left: its requests are aborted
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    data = []
    for index, vector in enumerate(vectors):
        if body.dimensions is not None:
            vector = truncate(vector, body.dimensions)
        embedding = encode_vector(vector, body.encoding_format)
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(len(ids) for ids in prompts)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def embed_prompts(
    request: Request, prompts: list[list[int]], fields: Mapping[str, Any], score: bool = False
) -> list[list[float]] | None:
    """Each prompt's pooled vector, in order (None: the client left, and the prompts were
    aborted); score: each prompt's [relevance], a reranker's pair. fields: the request
    model's, to name a refused parameter as it was sent."""
    engine = engine_of(request)
    if engine.max_waiting is not None and len(prompts) > engine.max_waiting:
        raise invalid(
            f"input has {len(prompts)} items, more than this server ever queues at once "
            f"({engine.max_waiting}, --max-waiting)",
            "input",
        )
    request_id = f"embd-{uuid.uuid4().hex}"
    try:
        stream = await engine.generate(
            request_id,
            prompts,
            SamplingParams(),
            cache_salt=cache_salt_for(request, None),
            embed=not score,
            score=score,
        )
    except (QueueFull, ShuttingDown, RequestError) as e:
        raise to_api_error(e, fields=fields) from None
    return await unless_disconnected(request, _collect(stream, len(prompts)))


async def _collect(stream: RequestStream, count: int) -> list[list[float]]:
    """Each input's vector, in input order; the rest aborted if cancelled."""
    vectors: list[list[float] | None] = [None] * count
    try:
        async for index, out in stream:
            if out.finished:
                if out.embedding is None:  # cut short: its prompt needs more than the KV pool
                    raise invalid(
                        f"input[{index}] has {out.num_prompt_tokens} tokens, more than this "
                        "server's KV cache holds",
                        "input",
                    )
                vectors[index] = out.embedding
    finally:
        stream.abort()
    return [v for v in vectors if v is not None]
