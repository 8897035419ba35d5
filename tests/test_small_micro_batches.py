"""Small micro-batches cost little, and the shortcuts that make them so compute what the
long way computes: `weights = "auto"` (dense when it fits the memory budget, the same bits
as quantized), a group's prompt computed once for the micro-batches its completions are
split over, the first epoch's forward reused as the behaviour log-probs and the reference
skipped while the adapter is zero."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_grpo import write_config

import retrograd
from retrograd.config import load_config
from retrograd.kernels import frozen
from retrograd.model.activation_memory import PASS_TOKENS_GLIBC, PASS_TOKENS_JEMALLOC, merging
from retrograd.model.lora import attach_lora
from retrograd.recipes import grpo
from retrograd.recipes.common import load_base, open_chat
from retrograd.training.batches import LogprobOptions, SharedPrefix
from retrograd.training.report import SilentReporter
from retrograd.training.rollout_step import PolicyOptimizer
from retrograd.training.scoring import (
    Rollout,
    micro_batch_logprobs,
    plan_passes,
    plan_shared,
    rollout_logprobs,
    scored_micro_batches,
)


@pytest.fixture
def one_thread():
    """These tests compare bits, not speed: on one thread the many tiny float32 GEMMs of a
    2-layer model do not stall on OpenMP barriers when another process holds a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rollouts(prompt_lengths=(23, 17), members=4) -> list[Rollout]:
    g = torch.Generator().manual_seed(1)
    out = []
    for group, n in enumerate(prompt_lengths):
        prompt = tuple(torch.randint(5, 200, (n,), generator=g).tolist())
        out += [Rollout(group, prompt, tuple(torch.randint(5, 200, (3 + j,), generator=g).tolist())) for j in range(members)]
    return out


def adapted(path, **kw):
    """A model with a LoRA whose B is not zero (so every gradient path carries something)."""
    model = retrograd.load_model(path, **kw)
    adapter = attach_lora(model.transformer, ["auto"], 4, 8.0, seed=0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.05, generator=g)
    return model.transformer, adapter


def train_pass(model, adapter, samples, budget):
    """log-probs of every sample and the adapter's gradients, micro-batch by micro-batch."""
    for p in adapter.parameters():
        p.grad = None
    out = [None] * len(samples)
    for batch, logp, mask in scored_micro_batches(model, samples, plan_shared(samples, budget), LogprobOptions(), "cpu"):
        (logp * mask).sum().backward()
        for row, i in enumerate(batch.rollouts):
            out[i] = logp[row][mask[row]].detach()
    return torch.cat(out), [p.grad.clone() for p in adapter.parameters()]


def test_auto_weights_are_dense_when_they_fit_and_say_so(tiny_model, tmp_path, monkeypatch):
    path = tiny_model("llama", qtype=QT.Q8_0)
    tokens = list(range(10, 60))
    for compute in ("f32", "bf16"):
        quantized = retrograd.load_model(path, weights="quantized", compute_dtype=compute)
        auto = retrograd.load_model(path, weights="auto", compute_dtype=compute)
        assert auto.weights_choice.startswith(f"auto: dense {compute}"), auto.weights_choice
        assert all(w.is_dense or w.kept is not None for w in auto.transformer.frozen_weights())
        assert torch.equal(auto.logits(tokens), quantized.logits(tokens))  # the same bits, only faster

    monkeypatch.setattr(frozen, "DENSE_BUDGET_FRACTION", 1e-9)
    small = retrograd.load_model(path, weights="auto")
    assert small.weights_choice.startswith("auto: quantized") and "exceed" in small.weights_choice
    assert not any(w.is_dense or w.kept is not None for w in small.transformer.frozen_weights())

    (tmp_path / "data.txt").write_text("hello world\n")
    (tmp_path / "sft.toml").write_text(f'[run]\nalgorithm = "sft"\n[model]\npath = "{path}"\n[output]\npath = "out/a.gguf"\n[sft]\ndata = "data.txt"\n')
    cfg = load_config(tmp_path / "sft.toml")
    assert cfg.model.weights == "auto"  # the default

    class Lines(SilentReporter):
        def __init__(self):
            self.lines = []

        def message(self, text):
            self.lines.append(text)

    reporter = Lines()
    load_base(cfg, reporter, open_chat(cfg))
    assert any(line.startswith("weights: auto: quantized") and "free RAM" in line for line in reporter.lines), reporter.lines


def test_plan_packs_whole_groups_and_splits_large_ones():
    samples = rollouts(prompt_lengths=(10, 10, 30), members=2)  # groups of 10 + 3 + 4 = 17 tokens, then 30 + 7 = 37
    assert [(b.rollouts, b.split) for b in plan_shared(samples, 40)] == [([0, 1, 2, 3], False), ([4, 5], False)]
    assert [(b.rollouts, b.split) for b in plan_shared(samples, 20)] == [([0, 1], False), ([2, 3], False), ([4, 5], True)]
    assert [(b.rollouts, b.split) for b in plan_shared(samples, 5)] == [
        ([0], True), ([1], True), ([2], True), ([3], True), ([4], True), ([5], True)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding-window layers, the window binds
def test_a_split_group_reads_its_prompt_once_and_gets_the_same_gradients(tiny_model, arch, one_thread):
    model, adapter = adapted(tiny_model(arch))
    samples = rollouts()
    for every in (0, 1):  # and with gradient checkpointing
        model.checkpoint_every = every
        whole_logp, whole_grads = train_pass(model, adapter, samples, budget=1000)
        split_logp, split_grads = train_pass(model, adapter, samples, budget=5)
        # other matmul shapes sum in another order: float32 rounding apart, not more
        torch.testing.assert_close(split_logp, whole_logp, rtol=1e-5, atol=1e-4)
        for g, h in zip(split_grads, whole_grads):  # measured: 7e-7 of the norm at most
            assert (g - h).norm() <= 1e-5 * h.norm()
        # scoring without gradients computes the same bits as the training forward
        assert torch.equal(torch.cat(rollout_logprobs(model, samples, LogprobOptions(), 5, "cpu")), split_logp)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters())


def update_rows(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


@pytest.mark.parametrize("micro_batch", [256, 12])  # whole groups; groups split over micro-batches
def test_reused_forward_and_skipped_reference_give_the_full_computation(tmp_path, tiny_model, monkeypatch, micro_batch, one_thread):
    runs = {}
    for reuse in (True, False):
        d = tmp_path / str(reuse)
        d.mkdir()
        cfg = write_config(d, tiny_model("llama"), updates=2, training='compute_dtype = "f32"', reward_name="length")
        cfg.write_text(cfg.read_text().replace("grpo_epochs = 1", "grpo_epochs = 2").replace("kl_coefficient = 0.0", "kl_coefficient = 0.05")
                       .replace("micro_batch = 256", f"micro_batch = {micro_batch}").replace("threads = 2", "threads = 1"))
        monkeypatch.setattr(PolicyOptimizer, "reuse_first_forward", reuse)
        grpo.run(load_config(cfg), SilentReporter())
        runs[reuse] = update_rows(d / "out/adapter.metrics.jsonl")
    reused, full = runs[True], runs[False]
    assert len(reused) == len(full) == 2
    for a, b in zip(reused, full):
        same = {k: v for k, v in a.items() if not k.startswith(("time", "timing/", "system/", "train/tokens_per_second", "sampler/"))}  # not clocks
        assert same == {k: b[k] for k in same}
    assert reused[0]["timing/behavior_scoring_seconds"] == reused[0]["timing/reference_seconds"] == 0.0
    assert full[0]["timing/behavior_scoring_seconds"] > 0 and full[0]["timing/reference_seconds"] > 0
    assert reused[1]["timing/reference_seconds"] > 0  # the adapter moved: the reference is a pass of its own again
    assert reused[1]["policy/kl"] > 0



def kept_for_backward(adapter, forward) -> int:
    """Bytes of the tensors `forward()` keeps for its backward (each storage once, the
    adapter's own parameters not counted), as autograd's saved-tensor hooks see them."""
    params = {p.untyped_storage().data_ptr() for p in adapter.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


def test_merged_passes_keep_no_more_than_the_micro_batches_they_replace(smollm2):
    """The smoke GRPO shape at micro_batch 8 (two groups of 8 four-token completions of a
    45-token prompt) on SmolLM2-135M. As configured, a split group's prompt stays computed
    while 8-token passes of its completions run; merged, one pass over both groups,
    checkpointed at every layer, keeps its checkpoints and, in backward, one recomputed layer
    and that layer's gradients. Measured with autograd's hooks, not estimated."""
    model, adapter = adapted(smollm2)
    g = torch.Generator().manual_seed(3)
    samples = [Rollout(group, tuple(range(100 + 45 * group, 145 + 45 * group)), tuple(torch.randint(5, 9000, (4,), generator=g).tolist()))
               for group in (0, 1) for _ in range(8)]
    micro_batch = 8
    small = merging(model.spec, micro_batch, 4, 4, checkpoint_every=0, checkpoint_bytes=4, cap=PASS_TOKENS_GLIBC)
    passes = plan_passes(samples, micro_batch, small, 0)
    alone = plan_passes(samples[:1], micro_batch, small, 0)  # one micro-batch either way: not checkpointed
    assert (alone.train, alone.checkpoint_every) == (micro_batch, 0) and alone.score == passes.score, alone
    assert merging(model.spec, 256, 4, 4, checkpoint_every=0, checkpoint_bytes=4, cap=PASS_TOKENS_JEMALLOC) is None  # large enough as they are
    assert merging(model.spec, 128, 4, 4, checkpoint_every=0, checkpoint_bytes=4, cap=PASS_TOKENS_JEMALLOC).budgets(128) == (512, 512)
    assert merging(model.spec, 8, 4, 4, checkpoint_every=4, checkpoint_bytes=4, cap=PASS_TOKENS_GLIBC) is None  # checkpointed already: little to gain
    plain, merged = plan_shared(samples, micro_batch), plan_shared(samples, passes.train)
    assert passes.checkpoint_every == 1 and (len(plain), len(merged)) == (8, 1), (passes, plain, merged)

    prefix = kept_for_backward(adapter, lambda: SharedPrefix(model, samples[0].prompt, "cpu"))
    shared = SharedPrefix(model, samples[0].prompt, "cpu")
    members = max(kept_for_backward(adapter, lambda: micro_batch_logprobs(model, [samples[i] for i in b.rollouts], LogprobOptions(), "cpu", shared))
                  for b in plain[:1])  # all alike: two completions of 4 tokens
    everything = [samples[i] for i in merged[0].rollouts]
    with model.checkpointed(1):
        checkpoints = kept_for_backward(adapter, lambda: micro_batch_logprobs(model, everything, LogprobOptions(), "cpu"))
    one_layer = kept_for_backward(adapter, lambda: micro_batch_logprobs(model, everything, LogprobOptions(), "cpu")) / model.spec.n_layer
    print(f"as configured {(prefix + members) / 2**20:.1f} MiB; merged {checkpoints / 2**20:.1f} MiB + 2 x {one_layer / 2**20:.1f} MiB")
    assert checkpoints + 2 * one_layer <= prefix + members
