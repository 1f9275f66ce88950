"""tokenmill: an LLM inference engine in Python that runs real models and shows its work."""

from tokenmill.llm import LLM, Completion, Output
from tokenmill.sampling import SamplingParams

__all__ = ["LLM", "Completion", "Output", "SamplingParams"]
__version__ = "0.1.0"
