"""dsv4: an inference engine for DeepSeek-V4-architecture models.

`LLM` and `SamplingParams` are imported on first use, so that `import dsv4` (and `dsv4 --help`) does not
import torch.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

# Public name -> the module that defines it.
_LAZY_EXPORTS = {"LLM": "dsv4.engine.llm", "SamplingParams": "dsv4.engine.sampling_params"}


def __getattr__(name: str):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
