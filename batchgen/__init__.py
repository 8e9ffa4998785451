"""batchgen: offline batch generation for causal language models."""

from batchgen.llm import LLM
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
