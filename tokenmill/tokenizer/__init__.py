"""Tokenizers (GGUF metadata or Hugging Face folders), streaming detokenization, chat templates."""

from .chat_template import ChatTemplateError
from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
