"""Our AdamW and SGD take torch.optim's steps bit for bit, carry torch's checkpoints across,
and spare a training run the 2 s import of torch._dynamo that torch.optim's first call costs."""

import copy

import pytest
import torch
from imports import run_noting_import
from test_sft import write_config

from retrograd.kernels.optim import SGD, AdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(8, 5), (5,), (3, 4, 2)]]


def _take_steps(optimizers, params_per_optimizer, steps: int, seed: int) -> None:
    """The same gradients for every optimizer's copy of the parameters, and a learning rate
    that changes between steps (as the schedule sets it)."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=generator) for p in params_per_optimizer[0]]
        for optimizer, params in zip(optimizers, params_per_optimizer):
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_steps_equal_torch_optim_bit_for_bit(kind, weight_decay):
    ours, theirs = _params(0), _params(0)
    if kind == "adamw":
        optimizers = [AdamW(ours, lr=1e-2, weight_decay=weight_decay),
                      torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)]
    else:
        optimizers = [SGD(ours, lr=1e-2, weight_decay=weight_decay),
                      torch.optim.SGD(theirs, lr=1e-2, weight_decay=weight_decay)]
    _take_steps(optimizers, [ours, theirs], steps=6, seed=1)
    assert not torch.equal(ours[0], _params(0)[0])  # the steps moved the weights
    for mine, torchs in zip(ours, theirs):
        assert torch.equal(mine, torchs)
    for field in ("step", "exp_avg", "exp_avg_sq") if kind == "adamw" else ():
        for mine, torchs in zip(optimizers[0].state_dict()["state"].values(), optimizers[1].state_dict()["state"].values()):
            assert mine[field].dtype == torchs[field].dtype and torch.equal(mine[field], torchs[field]), field


def test_state_moves_between_torch_adamw_and_ours_and_steps_on_identically():
    """A checkpoint written when the loops used torch.optim.AdamW resumes with ours, and the
    other way round: the same state dict layout, the same next steps."""
    torchs = _params(2)
    before = torch.optim.AdamW(torchs, lr=1e-2, weight_decay=0.1)
    _take_steps([before], [torchs], steps=3, seed=3)
    saved = before.state_dict()

    ours, again = [torch.nn.Parameter(p.detach().clone()) for p in torchs], [torch.nn.Parameter(p.detach().clone()) for p in torchs]
    resumed = AdamW(ours, lr=0.5, weight_decay=0.0)  # the saved hyperparameters win
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["weight_decay"] == 0.1 and resumed.param_groups[0]["lr"] == saved["param_groups"][0]["lr"]
    back = torch.optim.AdamW(again, lr=0.5)
    back.load_state_dict(copy.deepcopy(resumed.state_dict()))  # torch's load keeps the tensors it is given
    _take_steps([before, resumed, back], [torchs, ours, again], steps=3, seed=4)
    for a, b, c in zip(torchs, ours, again):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_state_of_another_shape_of_optimizer_is_refused():
    optimizer = AdamW(_params(0), lr=1e-2, weight_decay=0.0)
    saved = AdamW(_params(0)[:2], lr=1e-2, weight_decay=0.0).state_dict()
    with pytest.raises(ValueError, match="parameter groups do not match"):
        optimizer.load_state_dict(saved)


def test_a_training_run_does_not_import_torch_dynamo(tmp_path, tiny_model):
    """torch.optim's first step and torch.utils.checkpoint import torch._dynamo (2 s on a 2-core
    CPU); a run with our optimizer, gradient clipping, gradient checkpointing (model/recompute.py)
    and a checkpoint never does."""
    cfg = write_config(tmp_path, tiny_model("llama"), training="epochs = 1\nmax_grad_norm = 1.0\ngradient_checkpointing = true",
                       checkpoint='[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 2')
    r = run_noting_import("torch._dynamo", "train", str(cfg), cwd=tmp_path, timeout=300)
    assert r.stdout.strip().splitlines()[-1] == "exit 0, torch._dynamo imported: False", (r.stdout, r.stderr[-2000:])
    assert (tmp_path / "out" / "adapter.gguf").is_file() and list((tmp_path / "ckpt").glob("step-*.state"))
