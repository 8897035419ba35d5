"""llama.cpp generation with the live LoRA adapter: see sampler.py."""

from retrograd.sampler.engine import Placement
from retrograd.sampler.live_adapter import RefreshTiming
from retrograd.sampler.sampler import Completion, Conversation, GroupRequest, Sampler, SamplerOptions, SamplerStats
from retrograd.sampler.sampling import Sampling, sample_token

__all__ = [
    "Completion",
    "Conversation",
    "GroupRequest",
    "Placement",
    "RefreshTiming",
    "Sampler",
    "SamplerOptions",
    "SamplerStats",
    "Sampling",
    "sample_token",
]
