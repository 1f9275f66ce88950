"""Reranking: one relevance score per (query, document), from the final-norm hidden state
of the prompt's last token, as embeddings are pooled (engine/pooling.py: a prefill only,
nothing sampled).

Two kinds of reranker, told apart by the checkpoint:

    classifier  a *ForSequenceClassification checkpoint (Qwen3, Llama, Gemma ... with a
                `score` head [1, d] in place of the LM head): relevance = sigmoid(score . h)
                on the pair as the tokenizer joins two texts (its post-processor's pair
                template, as transformers' tokenizer(query, document) does)
    yes/no      a causal LM trained to answer "yes" or "no" (Qwen3-Reranker): the pair is
                written into its judging prompt (YES_NO_TEMPLATE) and relevance =
                P(yes) over {yes, no} = sigmoid(logit_yes - logit_no) from the LM head
    GGUF        llama.cpp's reranker files carry the head as `cls.output` [labels, d]: one
                label is a classifier's score, two a converted yes/no reranker's rows
                (no, yes), scored P(yes) on the judging prompt (or the file's own
                tokenizer.chat_template.rerank)

    read_scorer(path, arch, tokenizer, unembed)  -> Scorer (ScoringError if it cannot rank)
    Scorer.prompt(query, document, instruction)  -> the pair's token ids
    Scorer.score(hidden [d])                     -> the relevance in [0, 1]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Qwen3-Reranker's judging prompt (its model card), for every yes/no reranker
YES_NO_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
YES_NO_TEMPLATE = (
    "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class ScoringError(ValueError):
    """The model cannot rank (a classifier of several labels, no yes/no tokens ...)."""


@dataclass(frozen=True)
class Scorer:
    kind: str  # "classifier" or "yes_no"
    tokenizer: Any
    head: Callable[[torch.Tensor], torch.Tensor]  # hidden [1, d] -> [1, 1] logit
    architecture: str = ""
    judge: bool = False  # the pair goes into the judging prompt (a yes/no model's)
    template: str | None = None  # a GGUF's rerank template: {query}, {document} replaced

    def prompt(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        """The token ids the model scores for one (query, document) pair."""
        if self.template is not None:
            text = self.template.replace("{query}", query).replace("{document}", document)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self.judge:
            text = YES_NO_TEMPLATE.format(
                system=YES_NO_SYSTEM,
                instruction=instruction or DEFAULT_INSTRUCTION,
                query=query,
                document=document,
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        if instruction is not None:
            raise ScoringError(
                f"{self.architecture} scores pairs as it was trained: it takes no instruction"
            )
        return self.tokenizer.encode_pair(query, document)

    def score(self, hidden: torch.Tensor) -> float:
        """hidden [d] float32, the last token's final-norm state -> relevance in [0, 1]."""
        return torch.sigmoid(self.head(hidden[None]).float()[0, 0]).item()


def read_scorer(
    path: Path,
    tokenizer: Any,
    unembed: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> Scorer:
    """How the model at `path` ranks: its classification head when the checkpoint is a
    *ForSequenceClassification, else the yes/no rows of its LM head (`unembed`: [B, d] ->
    [B, vocab] logits)."""
    architecture = classifier_architecture(path)
    if architecture is not None and path.suffix == ".gguf":
        return _gguf_scorer(path, tokenizer, architecture)
    if architecture is not None:
        weight = _score_weight(path, architecture)
        if weight.shape[0] != 1:
            raise ScoringError(
                f"{architecture} has {weight.shape[0]} labels: a classifier of one score ranks, "
                "this one classifies"
            )
        weight = weight.to(torch.float32)
        return Scorer("classifier", tokenizer, lambda h: h.float() @ weight.t(), architecture)
    yes, no = (_single_token(tokenizer, word) for word in ("yes", "no"))

    def yes_minus_no(h: torch.Tensor) -> torch.Tensor:
        logits = unembed(h.to(dtype))  # [1, vocab]
        return (logits[:, yes] - logits[:, no])[:, None]

    return Scorer("yes_no", tokenizer, yes_minus_no, "a causal LM", judge=True)


def _gguf_scorer(path: Path, tokenizer: Any, architecture: str) -> Scorer:
    """llama.cpp's reranker files: a `cls.output` head [labels, d] on the last token. One
    label is a classifier's score (sigmoid); two are a converted yes/no reranker's
    (Qwen3-Reranker: rows no, yes; llama.cpp takes their softmax), so the score is
    P(yes) = sigmoid(l_yes - l_no), on the judging prompt. The file's own rerank template
    (tokenizer.chat_template.rerank) is used when it has one."""
    from tokenmill.loader.gguf_file import read_tensor
    from tokenmill.loader.gguf_reader import open_gguf_file

    f = open_gguf_file(path)
    t = next(t for t in f.tensors if t.name == "cls.output.weight")
    weight = torch.from_numpy(read_tensor(t, path).copy()).to(torch.float32)  # [labels, d]
    labels = weight.shape[0]
    if labels not in (1, 2):
        raise ScoringError(f"{architecture} has {labels} labels: it classifies, it does not rank")
    if labels == 1:
        diff = weight
    else:
        diff = weight[1:2] - weight[0:1]  # yes - no
    template = f.metadata.get("tokenizer.chat_template.rerank")
    template = template if isinstance(template, str) and "{document}" in template else None
    return Scorer(
        "classifier",
        tokenizer,
        lambda h: h.float() @ diff.t(),
        architecture,
        judge=labels == 2,
        template=template,
    )


def classifier_architecture(path: Path) -> str | None:
    """The *ForSequenceClassification architecture a model folder's config.json names, or
    a GGUF file's reranker head (cls.output, as llama.cpp's converter writes it); None for
    a causal LM."""
    if path.suffix == ".gguf" and path.is_file():
        from tokenmill.loader.gguf_reader import open_gguf_file

        f = open_gguf_file(path)
        if any(t.name == "cls.output.weight" for t in f.tensors):
            arch = f.metadata.get("general.architecture", "gguf")
            return f"{arch} reranker (cls.output)"
        return None
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    architectures = json.loads(config.read_text()).get("architectures") or []
    return next((a for a in architectures if a.endswith("ForSequenceClassification")), None)


def _score_weight(path: Path, architecture: str) -> torch.Tensor:
    """The classification head `score.weight` [labels, d] from the folder's safetensors."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            if "score.weight" in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return f.get_tensor("score.weight")
    raise ScoringError(f"{architecture} checkpoint at {path} has no score.weight head")


def _single_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False, parse_special=False)
    if len(ids) != 1:
        raise ScoringError(
            f"the vocabulary has no single token for {word!r}: this model cannot rank by yes/no"
        )
    return ids[0]
