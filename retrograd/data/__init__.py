"""Training data and rollout prompts: SFT examples (plain text, chat JSONL, tool records)
with an exact assistant loss mask, and prompt files for GRPO and distillation."""

from retrograd.data.prompts import Prompt, Prompts, completion_seed, load_prompts, order_name, prompt_index
from retrograd.data.sft import Example, SFTData, TokenSequence, load_sft
from retrograd.data.subset import evenly_spaced
from retrograd.data.template import CHAT_TEMPLATES, ChatFormat, resolve_chat_template

__all__ = [
    "CHAT_TEMPLATES",
    "ChatFormat",
    "Example",
    "Prompt",
    "Prompts",
    "SFTData",
    "TokenSequence",
    "completion_seed",
    "evenly_spaced",
    "load_prompts",
    "load_sft",
    "order_name",
    "prompt_index",
    "resolve_chat_template",
]
