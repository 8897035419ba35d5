"""Data-parallel training under torchrun: `torchrun --nproc_per_node R -m retrograd train run.toml`.

Every rank holds the whole frozen base and the same LoRA. A step's micro-batches are dealt
out round robin (micro-batch j to rank j mod R); each rank backpropagates its own, with the
loss divided by the step's global token count as on one rank, and the LoRA gradients are
summed across ranks (one all-reduce of one flat buffer) before clipping and the optimizer
step. So every rank takes the same step, and the step equals the one-rank step up to the
order of a float sum. Rank 0 alone writes checkpoints, the adapter, metrics and reports, and
(rollout algorithms) samples the rollouts that every rank then trains on.

Backends: gloo on the CPU, NCCL on CUDA GPUs (one GPU per rank: LOCAL_RANK).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

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
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

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


def init_ranks(device: torch.device | None = None) -> Ranks:
    """The process group torchrun describes in the environment (WORLD_SIZE, RANK, …), or one
    rank when run plainly."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    if not dist.is_initialized():
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return Ranks(dist.get_rank(), dist.get_world_size())
