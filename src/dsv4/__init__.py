"""dsv4: an inference engine for DeepSeek-V4-architecture models."""

from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
