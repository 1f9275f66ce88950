"""Reranking over the shared engine, in the shapes RAG pipelines send:

    POST /v1/rerank (/rerank, /v2/rerank)  Jina's and Cohere's: a query and documents
                                           (strings, or {"text": ...}) -> results ordered
                                           by relevance_score, at most top_n, each with
                                           its index (and the document unless
                                           return_documents is false); llama.cpp's and
                                           vLLM's paths
    POST /v1/score (/score)                vLLM's: text_1 against each of text_2 -> data
                                           [{index, score}] in text_2's order

Each pair is one prompt (engine/scoring.py builds it: the tokenizer's pair for a
*ForSequenceClassification checkpoint, the judging prompt for a yes/no reranker) run
through the prefill only, batched with whatever else runs, and scored from its last
token. A model that cannot rank (a classifier of several labels, a vocabulary with no
"yes") is a 400 naming the model.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.scoring import ScoringError
from tokenmill.server.embeddings_routes import MAX_INPUTS, embed_prompts
from tokenmill.server.errors import invalid, to_api_error
from tokenmill.server.json_body import json_body
from tokenmill.server.metrics import CLIENT_CLOSED_REQUEST
from tokenmill.server.running import check_model, engine_of, off_loop
from tokenmill.server.text import StrictModel, Text

router = APIRouter()


class TextDocument(StrictModel):
    text: Text


class RerankRequest(StrictModel):
    model: Text | None = None
    query: Text
    documents: list[Text | TextDocument]
    top_n: int | None = None
    return_documents: bool = True
    instruction: Text | None = None  # a yes/no reranker's task line (Qwen3-Reranker's)
    # Cohere's: how long a document may be; longer ones are refused here, not cut
    max_chunks_per_doc: int | None = Field(default=None, ge=1)


class ScoreRequest(StrictModel):
    model: Text | None = None
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    instruction: Text | None = None
    encoding_format: Text | None = None  # vLLM's; scores are numbers either way


def pair_prompts(
    engine: LLMEngine, query: str, documents: list[str], instruction: str | None
) -> list[list[int]]:
    """Each (query, document) pair's prompt, checked against the context. Runs on a worker
    thread."""
    if not documents:
        raise invalid("documents is empty: give at least one document", "documents")
    if len(documents) > MAX_INPUTS:
        raise invalid(f"documents has {len(documents)} items, more than {MAX_INPUTS}", "documents")
    try:
        scorer = engine.scorer
        prompts = [scorer.prompt(query, d, instruction) for d in documents]
    except ScoringError as e:
        raise to_api_error(e, param="model") from None
    limit = engine.max_model_len
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            raise invalid(
                f"documents[{i}] with the query is {len(ids)} tokens, more than the model's "
                f"context of {limit}",
                "documents",
            )
    return prompts


async def _scores(
    request: Request, query: str, documents: list[str], instruction: str | None, fields
) -> tuple[list[float], int] | None:
    """Each document's relevance to the query and the tokens the pairs took (None: the
    client left)."""
    engine = engine_of(request).engine
    prompts = await off_loop(request, pair_prompts, engine, query, documents, instruction)
    vectors = await embed_prompts(request, prompts, fields, score=True)
    if vectors is None:
        return None
    return [v[0] for v in vectors], sum(len(p) for p in prompts)


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(
    body: Annotated[RerankRequest, Depends(json_body(RerankRequest))], request: Request
) -> Response:
    model = check_model(request, body.model)
    if body.top_n is not None and body.top_n < 1:
        raise invalid(f"top_n must be at least 1, got {body.top_n}", "top_n")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scored = await _scores(request, body.query, texts, body.instruction, RerankRequest.model_fields)
    if scored is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    scores, tokens = scored
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


@router.post("/v1/score")
@router.post("/score")
async def score(
    body: Annotated[ScoreRequest, Depends(json_body(ScoreRequest))], request: Request
) -> Response:
    model = check_model(request, body.model)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(firsts) not in (1, len(seconds)):  # vLLM pairs text_1[i] with text_2[i]
        raise invalid(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
            "or as many as text_2",
            "text_1",
        )
    queries = firsts * len(seconds) if len(firsts) == 1 else firsts
    by_query: dict[str, list[int]] = {}  # each query's pairs go as one batch
    for i, query in enumerate(queries):
        by_query.setdefault(query, []).append(i)
    scores, tokens = [0.0] * len(seconds), 0
    for query, indices in by_query.items():
        docs = [seconds[i] for i in indices]
        scored = await _scores(request, query, docs, body.instruction, ScoreRequest.model_fields)
        if scored is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        for i, value in zip(indices, scored[0], strict=True):
            scores[i] = value
        tokens += scored[1]
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)]
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
