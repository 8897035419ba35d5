"""Packing: several examples in one row see nothing of each other; gradient checkpointing
gives the gradients of the plain forward."""

import pytest
import torch

import retrograd
from retrograd.data import TokenSequence
from retrograd.kernels.frozen import FrozenWeight
from retrograd.model.activation_memory import Merging
from retrograd.model.lora import attach_lora
from retrograd.model.recompute import checkpoint_segment
from retrograd.training.batches import Group, batch_logprobs, merge_micro_batches, pack, plan_micro_batches
from retrograd.training.optim import learning_rate


def seq(ids, first_trained=1):
    return TokenSequence(tuple(ids), tuple(i >= first_trained for i in range(len(ids))))


def test_plan_keeps_order_and_budget():
    assert plan_micro_batches([5, 5, 5, 20, 3, 3], 10) == [[0, 1], [2], [3], [4, 5]]


def test_a_steps_small_micro_batches_merge_in_order_within_the_largest_ones_memory():
    lengths = [30, 20, 25, 40, 10, 5, 33, 200]
    step = [[0, 1], [2], [3], [4, 5], [6]]  # the largest keeps 50 tokens; 163 in all
    assert merge_micro_batches(step, lengths, None) == (step, [False] * 5)
    assert merge_micro_batches(step, lengths, Merging(train=2.0, score=4.0, cap=512)) == ([[0, 1, 2], [3, 4, 5, 6]], [True, True])  # <= 100 tokens
    assert merge_micro_batches(step, lengths, Merging(train=4.0, score=8.0, cap=512)) == ([[0, 1, 2, 3, 4, 5, 6]], [True])
    # passes of <= 60 tokens would be 4 instead of 5: one pass saved does not pay for recomputing 163 tokens
    assert merge_micro_batches(step, lengths, Merging(train=4.0, score=8.0, cap=60)) == (step, [False] * 5)
    assert merge_micro_batches([[3, 0]], lengths, Merging(train=9.0, score=31.0, cap=512)) == ([[3, 0]], [False])  # one stays one
    # a long example runs alone and as configured; the short ones merge up to the cap
    assert merge_micro_batches([[0], [1], [4], [5], [7]], lengths, Merging(train=4.0, score=8.0, cap=100)) == ([[0, 1, 4, 5], [7]], [True, False])


def test_packed_rows_equal_separate_rows(tiny_model):
    for arch in ("llama", "gemma3"):  # gemma3: sliding-window layers with packing
        model = retrograd.load_model(tiny_model(arch)).transformer
        seqs = [seq(range(100, 131)), seq(range(400, 420), 5), seq(range(7, 60), 10)]
        packed = batch_logprobs(model, pack(seqs))
        separate = torch.cat([batch_logprobs(model, pack([s])) for s in seqs])
        # Different row lengths change the BLAS's and softmax's summation order, not the math.
        # rtol 1e-5 = 168 float32 ulps of log-probs around -10 to -60: 25x the largest gap
        # measured (4e-7 relative, with 1 and 2 threads), and a cross-talk between packed
        # examples moves them by 1e-2 or more.
        torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)
        assert packed.shape[0] == sum(s.n_trained for s in seqs)


def test_shared_prefix_equals_each_member_on_its_own(tiny_model):
    """GRPO scoring: a prompt packed once with its completions gives each completion the
    log-probs it has as a plain sequence prompt + completion."""
    for arch in ("qwen2", "gemma3"):
        model = retrograd.load_model(tiny_model(arch)).transformer
        prompt = tuple(range(500, 530))
        completions = [tuple(range(600, 612)), tuple(range(700, 703)), tuple(range(800, 825))]
        members = tuple(TokenSequence(c, (True,) * len(c)) for c in completions)
        shared = batch_logprobs(model, pack([Group(prompt, members), seq(range(40, 70))]))
        alone = [batch_logprobs(model, pack([TokenSequence(prompt + c, (False,) * len(prompt) + (True,) * len(c))])) for c in completions]
        torch.testing.assert_close(shared[: sum(map(len, completions))], torch.cat(alone), rtol=1e-5, atol=1e-5)


def lora_gradients(model):
    """A rank-4 LoRA on every family, B drawn (so A gets gradients too), and a function
    returning the adapter's gradients of one packed two-row batch."""
    adapter = attach_lora(model, ["auto"], 4, 8.0, seed=0)
    with torch.no_grad():
        for layer in adapter.layers.values():
            layer.lora_b.normal_(0, 0.02)
    batch = pack([seq(range(200, 260)), seq(range(300, 330))])

    def grads():
        for p in adapter.parameters():
            p.grad = None
        batch_logprobs(model, batch).sum().backward()
        return [p.grad.clone() for p in adapter.parameters()]

    return grads


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    model = retrograd.load_model(tiny_model("qwen3")).transformer
    grads = lora_gradients(model)
    plain = grads()
    for every in (1, 2):  # the recomputation repeats the forward's arithmetic: equal, bit for bit
        model.checkpoint_every = every
        assert all(torch.equal(g, h) for g, h in zip(plain, grads())), every
    model.checkpoint_every = 1
    model.checkpoint_dtype = torch.bfloat16  # block inputs kept in bf16: close, not equal
    rel = [float((g - h).norm() / g.norm()) for g, h in zip(plain, grads()) if g.norm() > 0]
    assert max(rel) < 0.05 and max(rel) > 0


def test_our_checkpointing_equals_torchs_bit_for_bit(tiny_model, monkeypatch):
    """model/recompute.py against torch.utils.checkpoint (non-reentrant), which it replaces to
    keep torch._dynamo out of a run: the same gradients, also with bf16 block inputs."""
    from torch.utils.checkpoint import checkpoint

    import retrograd.model.transformer as transformer

    model = retrograd.load_model(tiny_model("llama")).transformer
    grads = lora_gradients(model)
    for every, dtype in ((1, torch.float32), (2, torch.float32), (1, torch.bfloat16)):
        model.checkpoint_every, model.checkpoint_dtype = every, dtype
        ours = grads()
        with monkeypatch.context() as m:
            m.setattr(transformer, "checkpoint_segment", lambda fn, *args: checkpoint(fn, *args, use_reentrant=False))
            theirs = grads()
        assert all(torch.equal(g, h) for g, h in zip(ours, theirs)), (every, dtype)


def test_a_recomputation_that_saves_something_else_is_refused():
    """A segment whose forward is not a pure function of its inputs would get wrong
    gradients silently; the recomputation compares what it saves with what the forward did."""
    calls = []

    def segment(x):
        calls.append(1)
        return (x * x).sum() if len(calls) == 1 else (x[:2] * x[:2]).sum()

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"recomputed segment saved tensor 0 as \(2,\) torch.float32, its forward as \(4,\) torch.float32"):
        checkpoint_segment(segment, x).backward()


def test_a_checkpointed_pass_recomputes_all_but_each_segments_down_projection(tiny_model, monkeypatch):
    """The recomputation stops at a checkpointed segment's last saved tensor (its down
    projection's LoRA factors), before that projection's base matmul. So at a checkpoint per
    block each down projection is read twice per step (forward, backward), the other
    projections three times (forward, recomputation, backward). The gradients are those of
    the plain pass (test above)."""
    model = retrograd.load_model(tiny_model("qwen3")).transformer
    adapter = attach_lora(model, ["auto"], 4, 8.0, seed=0)
    batch = pack([seq(range(200, 260))])
    reads = []
    borrow = FrozenWeight.borrow_rows
    monkeypatch.setattr(FrozenWeight, "borrow_rows", lambda w, *a: reads.append(w.name) or borrow(w, *a))

    def reads_per_step(every: int, block: int) -> list[int]:
        reads.clear()
        model.checkpoint_every = every
        batch_logprobs(model, batch).sum().backward()
        return [reads.count(f"blk.{block}.{kind}.weight") for kind in ("attn_q", "attn_output", "ffn_up", "ffn_down")]

    assert len(model.blocks) == 2 and {"blk.1.attn_output.weight", "blk.1.ffn_down.weight"} <= set(adapter.layers)
    assert reads_per_step(0, 1) == [2, 2, 2, 2]
    assert reads_per_step(1, 1) == [3, 3, 3, 2]
    # one segment of both blocks: block 0 is recomputed whole (its q reads the embeddings, which
    # need no gradient: read by its forward and the recomputation, not by a backward matmul; _PlusBase
    # borrows the matrix even where it is held dense, as a slice), block 1 but its down projection
    assert reads_per_step(2, 0) == [2, 3, 3, 3]
    assert reads_per_step(2, 1) == [3, 3, 3, 2]


def test_learning_rate_schedules():
    kw = dict(lr=1.0, warmup_steps=2, total_steps=10)
    assert [learning_rate(s, schedule="constant", **kw) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert learning_rate(2, schedule="linear", **kw) == 1.0 and learning_rate(10, schedule="linear", **kw) == 0.0
    assert abs(learning_rate(6, schedule="cosine", **kw) - 0.5) < 1e-12
