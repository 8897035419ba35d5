"""Mixture of experts: the routed FFN that takes the dense FFN's place in a MoE layer,
computed as llama.cpp's build_moe_ffn (src/llama-graph.cpp) does.

Per token: router logits (ffn_gate_inp, in float32) -> gating (spec.expert_gating) ->
the n_expert_used largest gated values (plus a selection bias, lfm2moe's exp_probs_b) pick the
experts -> their gated values, without that bias, are the weights (renormalised to sum 1
and scaled when the spec says) -> each picked expert is a
gated FFN (ffn_gate_exps, ffn_up_exps, ffn_down_exps, one slice of each stack) -> the
expert outputs, times their weights, summed pick by pick (as llama.cpp adds its views).

Gradients flow into the weights (through the router's softmax) and through the experts;
the pick itself is discrete, as in llama.cpp. The tokens are grouped by expert:
each expert with tokens runs once over all of them, an expert nobody picked costs nothing,
and a quantized stack dequantizes only that expert's rows per use (or is held dense, as
any base weight, under `weights = "auto"`/"bf16"/"f32").

Ties: llama.cpp picks with ggml_argsort_top_k (on CPU std::sort, or in newer ggml
std::partial_sort, of the gated values, descending); we sort stably, so between exactly equal
values the lower expert index wins. ggml promises no order for exact ties (which float router
logits practically never give), nor, in newer versions, the order of the picks among
themselves: that only changes the rounding of the sum, not which experts run.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from retrograd.gguf.spec import ModelSpec
from retrograd.kernels.frozen import FrozenWeight, frozen_linear
from retrograd.model.layers import FrozenLinear, GatedProduct

# spec.expert_gating -> router logits [T, n_expert] -> the values the pick sorts
GATINGS = {
    "softmax": lambda logits: logits.softmax(-1),
    "sigmoid": torch.sigmoid,
    "softmax_weight": lambda logits: logits,  # gpt-oss: the softmax runs over the picked logits only
}
WEIGHT_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the sum it renormalises by (the smallest normal f16)


class FrozenExperts(FrozenLinear):
    """A stack of frozen expert matrices [n_expert, n_out, n_in] (one GGUF tensor), with gpt-oss's
    biases [n_expert, n_out] if given: forward(x, e) multiplies by expert e (and adds its bias).
    LoRA wraps it with a pair per expert (retrograd.model.lora), its delta added to this output."""

    def __init__(self, weight: FrozenWeight, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.n_expert = weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        n = self.out_features
        y = frozen_linear(x, self.weight, (expert * n, (expert + 1) * n))
        return y if self.bias is None else y + self.bias[expert].to(y.dtype)


def route(logits: torch.Tensor, spec: ModelSpec, selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, n_expert] (float32) -> (picked experts [T, k], their weights [T, k]),
    each row in pick order (largest first). `selection_bias` [n_expert] (lfm2moe's exp_probs_b)
    shifts the values the pick sorts; the weights are the unbiased gated values."""
    gated = GATINGS[spec.expert_gating](logits)
    ranked = gated if selection_bias is None else gated + selection_bias
    picked = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, : spec.n_expert_used]
    weights = gated.gather(-1, picked)
    if spec.expert_gating == "softmax_weight":
        weights = weights.softmax(-1)
    if spec.expert_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=WEIGHT_SUM_FLOOR)
    if spec.expert_weights_scale != 1.0:
        weights = weights * spec.expert_weights_scale
    return picked, weights


class MoEFeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: dict[str, FrozenWeight], vec: dict[str, torch.Tensor]):
        super().__init__()
        p = f"blk.{i}."
        # the router (a LoRA targets it by name only) and the expert stacks; the biases are gpt-oss's
        self.ffn_gate_inp = FrozenLinear(w[p + "ffn_gate_inp.weight"], vec.get(p + "ffn_gate_inp.bias"))
        self.ffn_gate_exps = FrozenExperts(w[p + "ffn_gate_exps.weight"], vec.get(p + "ffn_gate_exps.bias"))
        self.ffn_up_exps = FrozenExperts(w[p + "ffn_up_exps.weight"], vec.get(p + "ffn_up_exps.bias"))
        self.ffn_down_exps = FrozenExperts(w[p + "ffn_down_exps.weight"], vec.get(p + "ffn_down_exps.bias"))
        self.register_buffer("selection_bias", vec.get(p + "exp_probs_b.bias"), persistent=False)  # lfm2moe
        self.spec = spec
        self.act = spec.ffn_act

    def forward(self, x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
        """x [T, E] float32 -> [T, E] float32."""
        T, k = x.shape[0], self.spec.n_expert_used
        picked, weights = route(self.ffn_gate_inp(x.float()).float(), self.spec, self.selection_bias)  # [T, k] each
        slots = picked.flatten()  # [T * k]: token t's j-th pick is slot t * k + j
        by_expert = slots.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(slots, minlength=self.spec.n_expert).tolist()
        tokens = by_expert // k
        h = x.to(compute_dtype)
        outputs, start = [], 0
        for expert, n in enumerate(counts):
            if n:
                xe = h.index_select(0, tokens[start : start + n])
                gated = GatedProduct.apply(self.ffn_gate_exps(xe, expert), self.ffn_up_exps(xe, expert), None, None, None, None,
                                           self.act, compute_dtype)
                outputs.append(self.ffn_down_exps(gated, expert).float())
                start += n
        per_slot = torch.cat(outputs).index_select(0, by_expert.argsort())  # back in slot order [T * k, E]
        weighted = per_slot.view(T, k, -1) * weights.unsqueeze(-1)
        out = weighted[:, 0]
        for j in range(1, k):  # summed pick by pick, as llama.cpp adds its views
            out = out + weighted[:, j]
        return out
