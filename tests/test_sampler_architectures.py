"""The rollout path on every architecture: the llama.cpp sampler with the live adapter, as
GRPO drives it (Sampler.set_adapter after an update, groups of completions), samples
completions whose log-probs are those our torch forward with the same adapter gives the same
tokens. The completions run past the tiny fixtures' sliding windows (16 tokens) and original
contexts (64: YaRN, mistral3's attention temperature), with the prompt prefilled in two pieces
(sampler.PREFILL_CHUNK) and the completion decoded in steps with a second stream beside it.
phi3's long-RoPE factors are the set llama.cpp picks for the context the recipes give it.
What the sampler does differently for recurrent (convolution) layers: tests/test_sampler_recurrent.py."""

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf_factory import TINY_ARCHS, write_phi3_long_rope
from lora_files import randomise_b

import retrograd
from retrograd.config import parse_config
from retrograd.model.lora import attach_lora
from retrograd.recipes import grpo
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.sampler.sampler import PREFILL_CHUNK

ARCHS = sorted(TINY_ARCHS)
PROMPT, NEW = 70, 30  # positions 0..99: the prompt in pieces [0, 64) and [64, 70), every sampled token past 64
# A GRPO temperature that keeps every tiny model's sampled tokens uncertain: at 1 the tied-embedding
# fixtures (gemma3, qwen2, qwen3) give them log-probs of about 0 with or without the adapter (moved
# by under 3e-3), so a sampler that dropped the adapter would pass unseen
TEMPERATURE = 4.0
# |sampler - torch| per log-prob. The sampler's log-prob is the tempered log-softmax of llama.cpp's
# logits (tests/test_sampler.py: within 2e-4 of an independent llama.cpp eval) and our logits are
# within the adapter-export bound of 1e-3 of llama.cpp's (tests/arch_checks.py). Measured on these
# fixtures: at most 1e-5, gemma2 and gemma3 2.1e-4 (llama.cpp's float16 GELU table)
ATOL = 1e-3
# Each position-dependent feature switched off in our forward: the completions bind it
UNBOUND = {
    "gemma2": dict(sliding_window=1 << 20),
    "gemma3": dict(sliding_window=1 << 20),
    "gpt-oss": dict(sliding_window=1 << 20),
    "mistral3": dict(attn_temp_scale=0.0),
}


def _trained_adapter(model):
    """LoRA on `auto` with non-zero B, as after some updates."""
    adapter = attach_lora(model.transformer, ["auto"], rank=4, alpha=8.0, seed=0)
    randomise_b(adapter)
    return adapter


def _our_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    logits = model.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _gap(model, prompt, group, temperature: float = TEMPERATURE) -> float:
    """Largest |sampler log-prob - ours| over a group's tokens."""
    gaps = [torch.tensor(c.logprobs) - _our_logprobs(model, prompt, c.tokens, temperature) for c in group]
    return max(gap.abs().max().item() for gap in gaps)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollouts_carry_our_logprobs_with_the_live_adapter(tiny_model, ordinary_text, arch):
    base = tiny_model(arch)
    model = retrograd.load_model(base)
    adapter = _trained_adapter(model)
    prompt = model.tokenize(ordinary_text)[:PROMPT]
    assert len(prompt) == PROMPT > PREFILL_CHUNK
    with Sampler(base, SamplerOptions(n_ctx=PROMPT + NEW, n_seq_max=2, kv_dtype="f32", n_threads=1)) as s:
        s.set_adapter(adapter)
        (group,) = s.generate([GroupRequest(prompt, [1, 2], Sampling(NEW, temperature=TEMPERATURE))])
    assert _gap(model, prompt, group) <= ATOL
    with adapter.disabled():  # a sampler without the adapter would be far off
        assert _gap(model, prompt, group) > 30 * ATOL
    if arch in UNBOUND:  # and one that ignored the window or the temperature
        model.transformer.spec = dataclasses.replace(model.spec, **UNBOUND[arch])
        assert _gap(model, prompt, group) > 30 * ATOL


@pytest.fixture(scope="module")
def long_rope_phi3(tmp_path_factory) -> Path:
    return write_phi3_long_rope(tmp_path_factory.mktemp("phi3"), 300)


def _grpo_config(model: Path, ctx: int):
    grpo_section = {"prompts": "p.jsonl", "reward_function": "r.py:f", "updates": 1, "prompts_per_update": 1,
                    "group_size": 2, "grpo_epochs": 1, "clip_range_low": 0.2, "clip_range_high": 0.28,
                    "kl_coefficient": 0.0, "sampling": {"max_new_tokens": 20, "temperature": 1.0}}
    doc = {"run": {"algorithm": "grpo"}, "model": {"path": str(model)}, "output": {"path": "out/a.gguf"},
           "training": {"ctx": ctx, "threads": 1, "fast_sampling_context": False}, "grpo": grpo_section}
    return parse_config(doc, model.parent / "run.toml")


# original context 300: llama.cpp pads a sequence's context to a multiple of 256 and takes the long
# factors above 300, so ctx 256 rotates with the short set, 280 (padded to 512) and 320 with the long one
@pytest.mark.parametrize(("ctx", "long"), [(256, False), (280, True), (320, True)])
def test_phi3_rollouts_use_the_factor_set_training_uses(long_rope_phi3, ordinary_text, ctx, long):
    cfg = _grpo_config(long_rope_phi3, ctx)
    model = retrograd.load_model(long_rope_phi3)
    t = model.transformer
    t.use_context(cfg.training.ctx)  # as recipes/common.py load_base
    assert t.rope_global.factors is t.rope_factors[long]
    prompt = model.tokenize(ordinary_text)[:40]
    sampling = Sampling(cfg.grpo.sampling.max_new_tokens, temperature=cfg.grpo.sampling.temperature)
    with Sampler(long_rope_phi3, grpo.sampler_options(cfg)) as s:
        (group,) = s.generate([GroupRequest(prompt, [1, 2], sampling)])
    assert _gap(model, prompt, group, sampling.temperature) <= ATOL
    t.use_context(1 if long else 2048)  # the other set would be far off
    assert t.rope_global.factors is t.rope_factors[not long]
    assert _gap(model, prompt, group, sampling.temperature) > 30 * ATOL
