"""PPO's critic: a linear value head on the trunk's final hidden states, GAE advantages
per token, and the whitening and diagnostics around them (retrograd notes 4.3).

The head V(s) = w·h(s) + b reads the hidden state h(s) before each completion token (the
state that predicts it), so it costs no second model: one forward without gradients per
update captures the features, and fitting the head is a small full-batch regression.
The reward sits on a completion's last token and the value after it is 0:

    delta_t = r_t + gamma V(s_t+1) - V(s_t)
    A_t = sum_k (gamma lambda)^k delta_t+k        (GAE, Schulman et al. 2016)
    target_t = A_t + V(s_t)                        (the head is fit toward it)
"""

from __future__ import annotations

import torch

from retrograd.kernels.optim import AdamW

WHITEN_EPSILON = 1e-8
FEATURE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def gae(values: torch.Tensor, reward: float, gamma: float, lam: float) -> torch.Tensor:
    """[n] advantages of one completion of n tokens, given the head's values [n] before each
    token and the completion's reward on its last token."""
    n = values.shape[0]
    rewards = torch.zeros(n, dtype=torch.float64)
    rewards[-1] = reward
    following = torch.cat([values.double()[1:], torch.zeros(1, dtype=torch.float64)])  # [n]: V(s_t+1), 0 after the end
    deltas = rewards + gamma * following - values.double()  # [n]
    advantages = torch.empty(n, dtype=torch.float64)
    running = 0.0
    for t in range(n - 1, -1, -1):
        running = float(deltas[t]) + gamma * lam * running
        advantages[t] = running
    return advantages


def whiten(x: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit standard deviation (population) over all of `x`; all zeros when x is
    constant, so a batch without a learning signal trains nothing."""
    x = x.double()
    centred = x - x.mean()
    std = centred.pow(2).mean().sqrt()
    return centred / (std + WHITEN_EPSILON) if std > 0 else torch.zeros_like(x)


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var(target - predicted) / Var(target): 1 is a perfect critic, 0 one no better
    than a constant, below 0 worse; 0 when the targets do not vary."""
    var = target.double().var(unbiased=False)
    if var == 0:
        return 0.0
    return float(1 - (target.double() - predicted.double()).var(unbiased=False) / var)


class ValueHead:
    """V(s) = w·h / sqrt(E) + b, zero at the start, fit by full-batch Adam on the mean
    squared error. Adam moves every weight by about lr per step whatever its gradient's
    scale, so without the 1/sqrt(E) the E weights of a 576-wide trunk moved the value by
    hundreds of times lr in one step and the head overshot every batch. `state()` and
    `from_state` carry the weights and Adam's moments through a checkpoint's JSON exactly
    (float32 values round-trip through Python floats)."""

    def __init__(self, n_embd: int, lr: float):
        self.linear = torch.nn.Linear(n_embd, 1)
        self.scale = n_embd**-0.5
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        self.optimizer = AdamW(self.linear.parameters(), lr=lr, weight_decay=0.0)  # Adam: no decay

    def _values(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features.float() * self.scale)[:, 0]  # [n]

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """features [n, E] -> values [n] (no gradients)."""
        with torch.no_grad():
            return self._values(features)

    def fit(self, features: torch.Tensor, targets: torch.Tensor, epochs: int) -> float:
        """`epochs` full-batch Adam steps toward targets [n]; returns the error after them."""
        y = targets.float()
        for _ in range(epochs):
            loss = torch.nn.functional.mse_loss(self._values(features), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return float(torch.nn.functional.mse_loss(self(features), y))

    def state(self) -> dict:
        moments = self.optimizer.state_dict()["state"]
        return {
            "weight": self.linear.weight[0].tolist(),
            "bias": self.linear.bias[0].item(),
            "adam": {str(k): {name: v.tolist() for name, v in s.items()} for k, s in moments.items()},
        }

    @classmethod
    def from_state(cls, state: dict, lr: float) -> ValueHead:
        head = cls(len(state["weight"]), lr)
        with torch.no_grad():
            head.linear.weight[0] = torch.tensor(state["weight"])
            head.linear.bias[0] = state["bias"]
        saved = head.optimizer.state_dict()
        saved["state"] = {int(k): {name: torch.tensor(v, dtype=torch.float32) for name, v in s.items()}
                          for k, s in state["adam"].items()}
        head.optimizer.load_state_dict(saved)
        return head
