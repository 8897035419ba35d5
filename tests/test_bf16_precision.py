"""bf16 compute learns like float32: a LoRA step far below bf16's resolution of the base
outputs moves the bf16 forward pass as much as the float32 one.

A bf16 matmul returns bf16 numbers, and AdamW's first steps change a LoRA's output by about
1e-4 of the base output, where bf16 resolves 4e-3. Were a projection's float32 base + delta
cast back to bf16 by itself, it would round to the base output again: the gradients stay
right while the adapter's forward effect vanishes, and bf16 training falls behind float32
step by step. It did: the FFN's gate and up outputs and the values of long attention rows
were cast back, and the SFT benchmark's loss at step 20 was 0.61 in bf16 against 0.49.
"""

import random

import pytest
import torch

import retrograd
from retrograd.kernels.chunked_logprobs import token_logprobs
from retrograd.model.lora import attach_lora
from retrograd.model.transformer import SHORT_ROWS

LR = 1e-4  # the SFT benchmark's
TEXTS = 4


@pytest.fixture(scope="module")
def adapted(smollm2):
    """The bundled model (its real weights: a random one's step effects drown in rounding
    noise), bf16 weights so that both compute dtypes see the same base, a LoRA on every target."""
    model = retrograd.load_model(smollm2, weights="bf16")
    return model, attach_lora(model.transformer, ["auto"], rank=8, alpha=16.0, seed=0)


def mean_nll(transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The body in its compute dtype, the head in float32: the bf16 head rounds each logit
    (by up to 0.03 at |z| = 10), noise as large as one step's effect on a few hundred tokens."""
    hidden = transformer(tokens[:-1])  # [T - 1, E]
    logprobs, _ = token_logprobs(hidden, transformer.output, tokens[1:], compute_dtype=torch.float32)
    return -logprobs.mean()


@pytest.mark.parametrize(
    "families,n_sums,long_rows",
    [(None, 12, False), (None, 24, True), (("ffn_gate", "ffn_up"), 12, False)],
    ids=["all-short-rows", "all-long-rows", "gate-up"],
)
def test_one_adamw_step_moves_the_bf16_loss_as_much_as_the_f32_one(adapted, families, n_sums, long_rows):
    """Summed over TEXTS texts: on one text bf16's rounding noise alone moves the ratio by up
    to a quarter (gate and up: 0.75-1.35 over six texts, with the torch norms or the C ones),
    across the bounds, where the sums' ratio moves by a few hundredths."""
    f32 = bf16 = 0.0
    for seed in range(TEXTS):
        step_f32, step_bf16 = loss_changes(adapted, families, n_sums, long_rows, seed)
        assert step_f32 < -0.005, step_f32
        f32, bf16 = f32 + step_f32, bf16 + step_bf16
    # bf16 / f32 measured on AMD Zen 4 (all targets, ten texts): 0.94-1.10; when the delta
    # was rounded away 0.40-0.62 (gate and up alone: 0.31)
    assert 0.8 < bf16 / f32 < 1.25, f"the step changed the loss by {bf16:.4f} in bf16, {f32:.4f} in float32 ({TEXTS} texts)"


def loss_changes(adapted, families, n_sums: int, long_rows: bool, seed: int) -> tuple[float, float]:
    """One AdamW step's change of the mean NLL of one text, in float32 and in bf16 compute."""
    model, adapter = adapted
    transformer = model.transformer
    rng = random.Random(seed)
    text = " ".join(f"{a} plus {b} is {a + b}." for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n_sums)))
    tokens = torch.tensor(model.tokenize(text))
    assert (len(tokens) > SHORT_ROWS) == long_rows  # long rows attend in bf16 unless a LoRA feeds them

    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_b.zero_()
    for p in adapter.parameters():
        p.grad = None
    transformer.compute_dtype = torch.float32
    mean_nll(transformer, tokens).backward()
    with torch.no_grad():  # AdamW's first step from B = 0 (each entry moves by lr against its gradient's sign), on `families` only
        for name, layer in adapter.layers.items():
            if families is None or any(f".{f}." in name for f in families):
                layer.lora_b.copy_(-LR * layer.lora_b.grad.sign())

    def loss_change(dtype: torch.dtype) -> float:
        transformer.compute_dtype = dtype
        with torch.no_grad():
            stepped = mean_nll(transformer, tokens)
            with adapter.disabled():
                base = mean_nll(transformer, tokens)
        return float(stepped - base)

    return loss_change(torch.float32), loss_change(torch.bfloat16)
