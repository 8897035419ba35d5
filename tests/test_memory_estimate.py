"""retrograd.model.activation_memory.activation_bytes (preflight's "activations" line) against what autograd
really keeps: the bytes of every tensor saved for backward in one forward, counted once per
storage and without the model's own weights."""

import pytest
import torch

import retrograd
from retrograd.model.activation_memory import activation_bytes
from retrograd.model.lora import attach_lora
from retrograd.model.transformer import Layout


def saved_for_backward(transformer, ids: torch.Tensor, layout: Layout) -> int:
    weights = {w.data.untyped_storage().data_ptr() for w in transformer.frozen_weights()}
    weights |= {t.untyped_storage().data_ptr() for t in (*transformer.parameters(), *transformer.buffers())}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        transformer(ids, layout)
    return sum(saved.values())


@pytest.mark.parametrize("row", [1024, 256])
def test_gemma2_estimate_counts_its_soft_capped_score_matrices(tiny_model, row):
    """1024 tokens as one row, or packed as four rows of 256: gemma2's soft-capped attention keeps
    two float32 [heads, row, row] matrices per layer (tanh's and softmax's outputs), most of the
    activations at row 1024; the estimate must follow the row length within 25%."""
    model = retrograd.load_model(tiny_model("gemma2"))
    spec = model.spec
    attach_lora(model.transformer, ["auto"], 4, 8.0, seed=0)
    n = 1024
    rows = [list(range(start, start + row)) for start in range(0, n, row)]
    layout = Layout.from_rows(rows, [i % row for i in range(n)], [(r, j) for r in range(len(rows)) for j in range(row)])
    measured = saved_for_backward(model.transformer, torch.arange(100, 100 + n), layout)
    scores = 2 * spec.n_head * n * row * 4 * spec.n_layer
    if row == n:
        assert scores > 0.75 * measured  # the score matrices dominate
    estimate = activation_bytes(spec, n, 4, 4, row_length=row)
    assert 0.8 <= estimate / measured <= 1.25, (estimate, measured)


def test_bf16_compute_keeps_the_ffn_in_bf16(tiny_model):
    """In bf16 compute the widest activations, the FFN's gate and up, are kept in bf16 even
    with a LoRA on them (whose float32 sum feeds the gated product), and the estimate follows."""
    model = retrograd.load_model(tiny_model("llama"), weights="bf16")
    model.transformer.compute_dtype = torch.bfloat16
    spec = model.spec
    attach_lora(model.transformer, ["auto"], 4, 8.0, seed=0)
    n = 512
    tokens, layout = torch.arange(100, 100 + n), Layout.from_rows([list(range(n))], list(range(n)), [(0, j) for j in range(n)])
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model.transformer(tokens, layout)
    ffn_wide = [t for t in kept if t.shape == (n, spec.n_ff)]
    assert len(ffn_wide) >= 3 * spec.n_layer and all(t.dtype == torch.bfloat16 for t in ffn_wide)
    estimate, measured = activation_bytes(spec, n, 2, 4), saved_for_backward(model.transformer, tokens, layout)
    assert 0.8 <= estimate / measured <= 1.25, (estimate, measured)
