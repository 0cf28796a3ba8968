"""Token sampling: the persistent per-row parameter store, its per-step metadata, the sampler, and the
engine's custom logits processors (`tokenos.sample.logits_processor`, vLLM V1's interface)."""

from tokenos.sample.logprobs import compute_prompt_logprobs
from tokenos.sample.metadata import SamplingMetadata
from tokenos.sample.sampler import Sampler, SamplerOutput
from tokenos.sample.state import SamplingState

__all__ = ["SamplingMetadata", "SamplingState", "Sampler", "SamplerOutput", "compute_prompt_logprobs"]
