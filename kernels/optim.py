"""The optimizer update on the LoRA parameters: AdamW and SGD as torch.optim computes them on
a CPU, bit for bit, without torch.optim's machinery (whose first call imports torch._dynamo,
2 s of every run's start). The loop's choices around it (which optimizer, schedule,
clipping) are in retrograd.training.optim."""

from __future__ import annotations

import torch


class Optimizer:
    """The part of torch.optim.Optimizer our loops use (`param_groups`, `step`, `zero_grad`,
    `state_dict`, `load_state_dict`), with torch's state-dict layout, so checkpoints written
    while the loops used torch's optimizers load here."""

    def __init__(self, params, **hyper):
        self.param_groups = [{"params": list(params), **hyper}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        number = {p: i for i, p in enumerate(self._params())}
        groups, first = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(first, first + n))})
            first += n
        return {"state": {number[p]: dict(s) for p, s in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        """Saved moments cast to their parameter's device and dtype, the step count on the CPU
        (as torch keeps it: reading it is then no device sync), saved hyperparameters over the
        live ones; keys torch adds that we do not use (amsgrad, foreach, ...) are ignored."""
        groups = saved["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(live["params"]) for g, live in zip(groups, self.param_groups)):
            raise ValueError("the saved parameter groups do not match this optimizer's")
        params = dict(zip((i for g in groups for i in g["params"]), self._params()))
        self.state = {}
        for number, fields in saved["state"].items():
            p = params[int(number)]
            self.state[p] = {k: v.to("cpu", copy=True) if k == "step" else v.to(p.device, p.dtype, copy=True)
                             for k, v in fields.items()}
        for group, live in zip(groups, self.param_groups):
            live.update({k: group[k] for k in live if k != "params"})


class AdamW(Optimizer):
    """torch.optim.AdamW's arithmetic as its single-tensor path runs it (the path it takes
    on a CPU): the same operations in the same order, so the same numbers bit for bit."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p not in self.state:
                    self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
                state = self.state[p]
                state["step"] += 1
                if decay != 0:
                    p.mul_(1 - lr * decay)
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step = state["step"].item()
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


class SGD(Optimizer):
    """torch.optim.SGD without momentum: no state, the same arithmetic as torch's."""

    def __init__(self, params, lr: float, weight_decay: float):
        super().__init__(params, lr=lr, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] != 0 else p.grad
                    p.add_(grad, alpha=-group["lr"])
