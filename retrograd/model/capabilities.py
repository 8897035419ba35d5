"""`retrograd inspect`: what a GGUF file holds and how we would train on it, without
loading weights."""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.gguf.file import GGUFFile
from retrograd.gguf.spec import ModelSpec, read_spec
from retrograd.kernels.dequant import CODECS
from retrograd.model.lora import DEFAULT_TARGETS, EXPERT_FAMILIES, FUSED_FAMILIES, NAMED_TARGETS, TARGET_ALIASES
from retrograd.runtime.device import describe


@dataclass(frozen=True)
class TensorTypeRow:
    qtype: str
    count: int
    n_bytes: int
    handling: str  # how the frozen base keeps it


@dataclass(frozen=True)
class CapabilityReport:
    path: Path
    file_size: int
    spec: ModelSpec
    n_params: int
    tensor_types: tuple[TensorTypeRow, ...]
    lora_targets: tuple[tuple[str, int], ...]  # (alias or name pattern, weights matched)
    device: str

    def lines(self) -> list[str]:
        s = self.spec
        rope = f"{s.rope_style}, base {s.rope_base:g}, {s.n_rot} dims"
        if s.rope_freq_scale != 1.0:
            rope += f", {'YaRN' if s.rope_ext_factor else 'linear'} scale {1 / s.rope_freq_scale:g} (original context {s.rope_ctx_orig})"
        if s.rope_factors_long != s.rope_factors_short:
            rope += f", long-RoPE factors past a context of {s.rope_ctx_orig}"
        elif s.rope_factors_long:
            rope += f", frequency factors ({s.rope_factors_long})"
        if s.attn_temp_scale:
            rope += f", attention temperature {s.attn_temp_scale:g} per {s.attn_temp_length} positions"
        out = [
            f"model          {self.path}",
            f"file size      {_mib(self.file_size)}",
            f"architecture   {s.arch} ({s.name})",
            f"parameters     {self.n_params:,} ({self.n_params / 1e6:.1f} M)",
            f"layers         {s.n_layer}",
            f"heads          {s.n_head} query / {s.n_head_kv} key-value, head size {s.head_dim}",
            f"dimensions     embedding {s.n_embd}, feed-forward {_feed_forward(s)} ({s.ffn_act})",
            f"context        {s.context_length} tokens",
            f"vocabulary     {s.n_vocab} tokens",
            f"rope           {rope}",
        ]
        attention = [f"sliding window {s.sliding_window} on {sum(s.swa_layers)} of {s.n_layer} layers"] if s.sliding_window else []
        attention += ["a learned sink logit per head (frozen)"] if s.attn_sinks else []
        attention += [f"scores soft-capped at {s.attn_logit_softcap:g}"] if s.attn_logit_softcap else []
        if attention:
            out.append("attention      " + "; ".join(attention))
        if any(s.conv_layers):
            out.append(f"mixers         gated short convolution (kernel {s.conv_kernel}) on {sum(s.conv_layers)} of {s.n_layer} layers, attention on the rest")
        if s.n_expert:
            routing = s.expert_gating + (", renormalised" if s.expert_weights_norm else "")
            routing += f", scaled by {s.expert_weights_scale:g}" if s.expert_weights_scale != 1.0 else ""
            routing += ", picked with a selection bias" if s.expert_selection_bias else ""
            out.append(
                f"experts        {s.n_expert_used} of {s.n_expert} per token ({routing}), each {s.n_ff_exp} wide, on {sum(s.moe_layers)} "
                f"of {s.n_layer} layers; ffn_up/ffn_gate/ffn_down adapt the expert stacks, a LoRA pair per expert; "
                "the router by name (blk.*.ffn_gate_inp.weight)"
            )
        out += [
            f"output head    {'tied to token_embd' if s.tied_output else 'output.weight'}",
            f"chat template  {'present' if s.chat_template else 'absent (chat data needs a template)'}",
            "tensor types",
        ]
        for r in self.tensor_types:
            out.append(f"  {r.qtype:<6} {r.count:>5} tensors {_mib(r.n_bytes):>11}  {r.handling}")
        targets = ", ".join(f"{alias} ({n})" for alias, n in self.lora_targets)
        out += [f"lora targets   {targets}", f"device         {self.device}"]
        return out


def _feed_forward(s: ModelSpec) -> str:
    """The FFN's hidden width: a mixture's is each expert's (expert_feed_forward_length), and
    leading dense layers (lfm2moe) keep feed_forward_length."""
    n_moe = sum(s.moe_layers)
    if not n_moe:
        return str(s.n_ff)
    experts, n_dense = f"{s.n_ff_exp} per expert", s.n_layer - n_moe
    return experts if not n_dense else f"{s.n_ff} on {n_dense} dense layer{'s' * (n_dense > 1)}, {experts} on {n_moe}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _handling(qtype, ndim: int) -> str:
    if ndim == 1:
        return "float32 vector"
    if qtype.name in ("F32", "F16", "BF16"):
        return "used as stored"
    return "kept in blocks, dequantized per matmul" if qtype in CODECS else "dequantized once at load"


def inspect_model(path: Path, device: torch.device) -> CapabilityReport:
    f = GGUFFile(path)
    spec = read_spec(f)
    counts: Counter = Counter()
    sizes: Counter = Counter()
    handling = {}
    n_params = 0
    for t in f.tensors.values():
        counts[t.qtype.name] += 1
        sizes[t.qtype.name] += t.n_bytes
        handling.setdefault(t.qtype.name, set()).add(_handling(t.qtype, len(t.shape)))
        n = 1
        for d in t.shape:
            n *= d
        n_params += n
    rows = tuple(
        TensorTypeRow(q, counts[q], sizes[q], "; ".join(sorted(handling[q]))) for q in sorted(counts, key=lambda q: -sizes[q])
    )

    def family_count(family: str) -> int:
        return sum(1 for name in f.tensors if name.startswith("blk.") and name.endswith(f".{family}.weight"))

    # an alias whose family is fused into another (phi3) counts the fused weights, as resolve_targets picks them;
    # an FFN alias counts a mixture's expert stacks too
    targets = tuple(
        (alias, family_count(TARGET_ALIASES[alias]) + family_count(EXPERT_FAMILIES.get(TARGET_ALIASES[alias], ""))
         or family_count(FUSED_FAMILIES.get(TARGET_ALIASES[alias], "")))
        for alias in DEFAULT_TARGETS
    ) + tuple((pattern, n) for pattern in NAMED_TARGETS if (n := len(fnmatch.filter(f.tensors, pattern))))
    return CapabilityReport(path, f.size, spec, n_params, rows, targets, describe(device))
