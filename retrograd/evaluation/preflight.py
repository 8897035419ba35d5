"""`retrograd preflight`: load the model on the training device, attach a throwaway LoRA,
run one real forward+backward, and report what would run off the device and how much
memory a run of the given geometry needs."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from retrograd.kernels.chunked_logprobs import token_logprobs
from retrograd.model.activation_memory import activation_bytes
from retrograd.model.base import load_model
from retrograd.model.lora import attach_lora
from retrograd.runtime import allocator
from retrograd.runtime.device import describe, off_device
from retrograd.runtime.memory import PeakMemory
from retrograd.sampler import Placement

PROBE_TEXT = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep by the river. "
PROBE_TOKENS = 32


@dataclass(frozen=True)
class PreflightReport:
    path: Path
    device: str
    allocator: str
    weights_mode: str
    compute_dtype: str
    lora_summary: str
    probe_tokens: int
    probe_seconds: float
    probe_loss: float
    off_device: tuple[str, ...]
    sampler: str  # where llama.cpp samples rollouts: device(s), layers offloaded
    notes: tuple[str, ...]
    ctx: int
    micro_batch: int
    estimates: tuple[tuple[str, int], ...]
    probe_peak: int
    probe_peak_kind: str

    @property
    def ok(self) -> bool:
        return math.isfinite(self.probe_loss)

    def lines(self) -> list[str]:
        out = [
            "training preflight",
            f"model          {self.path}",
            f"device         {self.device}",
            f"allocator      {self.allocator}",
            f"weights        {self.weights_mode}, compute {self.compute_dtype}",
            f"probe          {self.probe_tokens} tokens, {self.lora_summary}: forward+backward "
            f"{self.probe_seconds:.2f} s, loss {self.probe_loss:.3f}",
            f"off device     {'; '.join(self.off_device) if self.off_device else 'none'}",
            f"sampler        llama.cpp on {self.sampler}",
        ]
        out += [f"note           {n}" for n in self.notes]
        out.append(f"memory estimate for ctx {self.ctx}, micro-batch {self.micro_batch} tokens")
        for label, n in self.estimates:
            out.append(f"  {label:<16} {n / 2**20:10.1f} MiB")
        out.append(f"probe peak     {self.probe_peak / 2**20:.1f} MiB {self.probe_peak_kind}")
        out.append(f"status: {'ok' if self.ok else 'failed (the probe loss is not finite)'}")
        return out


def run_preflight(
    path: Path | None,
    device: torch.device,
    *,
    targets: list[str],
    rank: int = 2,
    alpha: float = 4.0,
    ctx: int = 128,
    micro_batch: int = 32,
    weights: str = "auto",
    compute_dtype: str = "f32",
) -> PreflightReport:
    model = load_model(path, weights=weights, compute_dtype=compute_dtype, device=device)
    spec = model.spec
    adapter = attach_lora(model.transformer, targets, rank, alpha, seed=0)

    ids = model.tokenize(PROBE_TEXT * 4)[: PROBE_TOKENS + 1]
    tokens = torch.tensor(ids[:-1], device=device)
    targets_t = torch.tensor(ids[1:], device=device)
    t0 = time.perf_counter()
    with PeakMemory() as peak:
        hidden = model.transformer(tokens)  # [T, E]
        logprobs, _ = token_logprobs(hidden, model.transformer.output, targets_t, compute_dtype=model.compute_dtype)
        loss = -logprobs.mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    unreached = [name for name, layer in adapter.layers.items() if layer.lora_b.grad is None or not layer.lora_b.grad.abs().sum() > 0]
    notes = list(model.notes)
    if unreached:
        notes.append(f"{len(unreached)} LoRA weights received no gradient (first: {unreached[0]})")


    n_lora = adapter.n_parameters()
    compute_bytes = 2 if compute_dtype == "bf16" else 4
    estimates = (
        ("base weights", model.weight_bytes),
        ("lora", n_lora * 4),
        ("optimizer state", n_lora * 12),  # AdamW first and second moments + the gradient, float32
        ("activations", activation_bytes(spec, micro_batch, compute_bytes, rank, row_length=ctx)),
    )
    estimates += (("total", sum(n for _, n in estimates)),)
    families = sorted({name.split(".")[2] for name in adapter.layers})
    return PreflightReport(
        path=model.path,
        device=describe(device),
        allocator=allocator.current(),
        weights_mode=model.weights_choice,
        compute_dtype=compute_dtype,
        lora_summary=f"LoRA rank {rank} on {len(adapter.layers)} weights ({', '.join(families)})",
        probe_tokens=len(ids) - 1,
        probe_seconds=seconds,
        probe_loss=float(loss.detach()),
        off_device=tuple(off_device(device, sampling=True)),
        sampler=Placement.for_model(spec.n_layer).describe(),
        notes=tuple(notes),
        ctx=ctx,
        micro_batch=micro_batch,
        estimates=estimates,
        probe_peak=peak.cuda_peak if peak.cuda_peak is not None else peak.rss_increase,
        probe_peak_kind="CUDA allocator peak" if peak.cuda_peak is not None else "host RSS increase",
    )

