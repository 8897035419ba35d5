"""Reference logits from llama.cpp itself (llama-cpp-python), for parity tests."""

from __future__ import annotations

import numpy as np
import torch

from retrograd.runtime.llamacpp import llama_cpp

F32 = 0  # GGML_TYPE_F32, for type_k / type_v
# llama_cpp.Llama passes YaRN's magnitude 1 and betas 32 / 1 to the context; -1 leaves them to the model
# file as llama.cpp's own default context parameters do (the sampler's, llama-server's)
YARN_FROM_MODEL = dict(yarn_attn_factor=-1.0, yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)


def llama_logits(path, ids: list[int], *, lora_path=None, kv_f32: bool = True, flash_attn: bool = False) -> torch.Tensor:
    """llama.cpp's logits [len(ids), n_vocab] for one sequence evaluated in one batch (an f16
    KV cache read by flash attention is how the sampler and serve run)."""
    n = len(ids)
    kv = (dict(type_k=F32, type_v=F32) if kv_f32 else {}) | dict(flash_attn=flash_attn)
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=max(n, 64), n_batch=n, n_ubatch=n, logits_all=True,
        verbose=False, n_threads=2, lora_path=str(lora_path) if lora_path else None, **kv, **YARN_FROM_MODEL,
    )
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:n], dtype=np.float32))
    finally:
        llm.close()


def agreement(reference: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || ours), top-1 agreement) over positions."""
    lp_ref, lp = reference.log_softmax(-1), ours.float().log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    top1 = (reference.argmax(-1) == ours.argmax(-1)).float().mean()
    return kl.mean().item(), top1.item()


NEAR_TIE = 1e-3  # logits; 15x the largest |torch - llama.cpp| logit gap on the F32 models (6.8e-5)


def top1_disagreements(reference: torch.Tensor, ours: torch.Tensor, near_tie: float = NEAR_TIE) -> list[int]:
    """Positions whose argmax differs although the reference's top two logits are at least
    `near_tie` apart. Where they are closer, either answer is right: which one wins depends
    on each implementation's summation order (this CPU's BLAS or SIMD width), not on bugs."""
    top2 = reference.topk(2, dim=-1).values  # [T, 2]
    decided = (top2[:, 0] - top2[:, 1]) >= near_tie  # [T]
    differs = reference.argmax(-1) != ours.float().argmax(-1)  # [T]
    return (differs & decided).nonzero().flatten().tolist()
