"""Data-parallel training under torchrun: `torchrun --nproc_per_node R -m retrograd train run.toml`.

Every rank holds the whole frozen base and the same LoRA. A step's micro-batches are dealt
out round robin (micro-batch j to rank j mod R); each rank backpropagates its own, with the
loss divided by the step's global token count as on one rank, and the LoRA gradients are
summed across ranks (one all-reduce of one flat buffer) before clipping and the optimizer
step. So every rank takes the same step, and the step equals the one-rank step up to the
order of a float sum. Rank 0 alone writes checkpoints, the adapter, metrics and reports, and
(rollout algorithms) samples the rollouts that every rank then trains on.

Backends: gloo on the CPU, NCCL on CUDA GPUs (one GPU per rank: LOCAL_RANK; not yet run on
GPUs). The micro-batches of distillation's JSD loss are not dealt out (every rank computes
them all; the step is the same), and offline distillation refuses to run under torchrun.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(hours=12)  # ranks wait at a broadcast while rank 0 samples a whole update;
# torchrun ends the group when a rank dies, so a long wait is never a silent hang


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where collective tensors live: the rank's GPU under NCCL

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def spread(self) -> bool:
        return self.world > 1

    def share(self, items: list) -> list[int]:
        """The indices of `items` this rank works on."""
        return list(range(self.rank, len(items), self.world))

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum every parameter's gradient across ranks (None counts as zeros), in place."""
        if not self.spread:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset: offset + n].view_as(p).clone()
            offset += n

    def sum_floats(self, values: list[float]) -> list[float]:
        """Float64 sums across ranks of a few numbers (losses, token counts)."""
        if not self.spread:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.spread:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank."""
        if not self.spread:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def launched_as_rank_zero() -> bool:
    """True unless torchrun started this process as another rank (read from the
    environment, before any process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun each rank trains on the GPU of its LOCAL_RANK (cuda:0 otherwise)."""
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def init_ranks(device: torch.device | None = None) -> Ranks:
    """The process group torchrun describes in the environment (WORLD_SIZE, RANK, …), or one
    rank when run plainly."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    nccl = device is not None and device.type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if nccl else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size(), str(device) if nccl else "cpu")
