"""The llama.cpp sampler on the real SmolLM2: reproducibility whatever the batching, one
prompt prefill per group, stop reasons, log-probs against an independent llama.cpp eval,
the live adapter, multi-turn cache reuse and the one-line errors."""

import shutil

import numpy as np
import pytest
import torch
from gguf_factory import write_tiny_model
from llama_ref import llama_logits
from lora_files import randomise_b

import retrograd
from retrograd.errors import DataError
from retrograd.gguf.adapter import LoRAWeights, adapter_tensors, read_adapter, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.model.lora import attach_lora
from retrograd.model.tokenizer import Tokenizer
from retrograd.runtime.llamacpp import C, llama_cpp
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling, live_adapter
from retrograd.sampler.live_adapter import RANK_MULTIPLE, padded_for_llama

N_CTX = 128


@pytest.fixture(scope="module")
def chat(smollm2):
    tok = Tokenizer(smollm2)
    return lambda text: tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def sampler(path, n_seq_max=8, kv_dtype="f32", n_batch=512):
    return Sampler(
        path, SamplerOptions(n_ctx=N_CTX, n_seq_max=n_seq_max, n_batch=n_batch, kv_dtype=kv_dtype, n_threads=1)
    )


def outcome(groups):
    return [[(c.tokens, c.logprobs, c.finish) for c in g] for g in groups]


def reference_logprobs(path, context, tokens, lora_path=None, temperature: float = 1.0, pieces=None) -> np.ndarray:
    """An independent single-sequence llama.cpp eval (llama_cpp.Llama, f32 KV): log-softmax
    at `temperature` of the logits that predicted each sampled token. It evaluates in the
    sampler's order, the context in one batch (or in the `pieces` its cache was built from)
    and then one token at a time: with AVX2, llama.cpp's batched kernels sum in another order
    than its one-token ones, and a batched eval of the whole sequence moved one log-prob by
    7.9e-3 on a Zen 3 (within 2e-4 on AVX-512)."""
    pieces = pieces or [context]
    assert [t for piece in pieces for t in piece] == list(context)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=N_CTX,
        n_batch=len(context),
        n_ubatch=len(context),
        logits_all=True,
        verbose=False,
        n_threads=1,
        n_threads_batch=1,
        type_k=C.GGML_TYPE_F32,
        type_v=C.GGML_TYPE_F32,
        lora_path=str(lora_path) if lora_path else None,
    )
    try:
        for piece in pieces:
            llm.eval(list(piece))
        for token in tokens[:-1]:
            llm.eval([token])
        logits = torch.from_numpy(np.array(llm.scores[len(context) - 1 : len(context) + len(tokens) - 1], dtype=np.float32))
    finally:
        llm.close()
    return (logits.double() / temperature).log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_same_seeds_same_completions_whatever_concurrency_and_order(smollm2, chat, kv_dtype):
    sampling = Sampling(10)
    requests = [
        GroupRequest(chat("Name a fruit."), [11, 12, 13], sampling),
        GroupRequest(chat("Count to five."), [21, 22, 23, 24], sampling),
    ]
    with sampler(smollm2, n_seq_max=1, kv_dtype=kv_dtype) as s:
        serial = outcome(s.generate(requests))
    with sampler(smollm2, n_seq_max=8, kv_dtype=kv_dtype) as s:
        batched = outcome(s.generate(requests))
        reordered = outcome(s.generate(requests[::-1])[::-1])
    with sampler(smollm2, n_seq_max=3, kv_dtype=kv_dtype, n_batch=4) as s:  # prompts prefilled 1-3 tokens at a time
        partial = outcome(s.generate([requests[1], GroupRequest(chat("Say hi."), [5], sampling), requests[0]]))
    assert batched == serial == reordered
    assert [partial[2], partial[0]] == serial
    assert len({tuple(t) for t, _, _ in serial[1]}) > 1  # different seeds, different completions


def test_group_prompt_is_prefilled_once(smollm2, chat):
    prompt = chat("Write a haiku about the sea.")
    for n_seq_max in (8, 3):  # all members at once, or in waves that take over finished slots
        with sampler(smollm2, n_seq_max=n_seq_max) as s:
            (group,) = s.generate([GroupRequest(prompt, list(range(6)), Sampling(4))])
            assert s.stats.prefilled == len(prompt)
            assert sorted(c.prefilled for c in group) == [0] * 5 + [len(prompt)]
            assert all(c.reused == len(prompt) for c in group if c.prefilled == 0)
            assert len({tuple(c.tokens) for c in group}) > 1


def test_stops_at_end_of_generation_or_at_max_new_tokens(smollm2, chat):
    with sampler(smollm2) as s:
        (group,) = s.generate(
            [GroupRequest(chat("What is 2+3? Answer with a number."), range(8), Sampling(12, temperature=0.3))]
        )
    eog = s.eog_ids
    for c in group:
        assert not any(t in eog for t in c.tokens[:-1]) and len(c.tokens) == len(c.logprobs)
        assert c.finish == ("eos" if c.tokens[-1] in eog else "length")
        assert c.finish == "eos" or len(c.tokens) == 12
    assert any(c.finish == "eos" for c in group)
    with sampler(smollm2) as s:
        (group,) = s.generate([GroupRequest(chat("Tell me a long story."), [1, 2], Sampling(3))])
    assert [(len(c.tokens), c.finish) for c in group] == [(3, "length"), (3, "length")]


def test_logprobs_are_the_tempered_softmax_of_llama_logits(smollm2, chat):
    prompt = chat("Name three colors.")
    with sampler(smollm2) as s:
        (group,) = s.generate([GroupRequest(prompt, [3, 4], Sampling(8, temperature=0.7))])
    for c in group:
        np.testing.assert_allclose(c.logprobs, reference_logprobs(smollm2, prompt, c.tokens, temperature=0.7), atol=2e-4)


@pytest.fixture(scope="module")
def trained_adapter(smollm2):
    """A rank-8 LoRA on all seven families with non-zero B, as after some training."""
    adapter = attach_lora(retrograd.load_model(smollm2).transformer, ["auto"], rank=8, alpha=16.0, seed=0)
    randomise_b(adapter, 0.02)
    return adapter


def test_live_adapter_matches_llama_with_the_same_file_and_clears_back_to_base(
    smollm2, chat, trained_adapter, tmp_path
):
    prompt = chat("Give me a word.")
    request = [GroupRequest(prompt, [9, 10], Sampling(6))]
    with sampler(smollm2) as s:
        base = s.generate(request)
        folder = s.adapter.folder
        timing = s.set_adapter(trained_adapter)
        assert timing.total_s > 0 and folder.is_dir()
        live = read_adapter(s.adapter.file)  # rank-padded: test_the_rank_padded_file_gives_llama_the_same_model
        padded = -(-8 // RANK_MULTIPLE) * RANK_MULTIPLE
        assert live.rank == padded and live.alpha == trained_adapter.alpha * padded / 8
        lora_file = shutil.copy(s.adapter.file, tmp_path / "live.gguf")
        tuned = s.generate(request)
        assert s.stats.prefilled == 2 * len(prompt)  # the weight change dropped the cached prompt
        for b, t in zip(base[0], tuned[0]):
            assert t.tokens != b.tokens or not np.allclose(t.logprobs, b.logprobs, atol=1e-3)
            np.testing.assert_allclose(
                t.logprobs, reference_logprobs(smollm2, prompt, t.tokens, lora_path=lora_file), atol=2e-4
            )
        s.set_adapter(trained_adapter)  # a second refresh replaces the first adapter
        assert outcome(s.generate(request)) == outcome(tuned)
        s.set_adapter(None)
        assert outcome(s.generate(request)) == outcome(base)
    assert not folder.exists()  # closing removed the adapter file


def test_a_refresh_with_the_same_layout_rewrites_the_file_in_place_and_samples_the_new_weights(
    smollm2, chat, trained_adapter, tmp_path
):
    """The second refresh only overwrites the tensor data of the file the first wrote: the
    bytes are those of a fresh write of the new weights (rank-padded), and the samples those
    of a sampler that only ever saw the new weights."""
    request = [GroupRequest(chat("Give me a word."), [9, 10], Sampling(6))]
    first = adapter_tensors(trained_adapter)
    second = {name: type(w)(w.a * 0.5, w.b * -1.5) for name, w in first.items()}
    f = GGUFFile(smollm2)
    padded, alpha = padded_for_llama(second, trained_adapter.alpha)
    fresh = write_adapter(tmp_path / "second.gguf", padded, arch=f.get("general.architecture"), alpha=alpha,
                          base_shapes={n: t.shape for n, t in f.tensors.items()})
    with sampler(smollm2) as s:
        s.set_adapter(first, alpha=trained_adapter.alpha)
        inode = s.adapter.file.stat().st_ino
        s.set_adapter(second, alpha=trained_adapter.alpha)
        assert s.adapter.file.stat().st_ino == inode  # rewritten in place, not written anew
        assert s.adapter.file.read_bytes() == fresh.read_bytes()
        after = outcome(s.generate(request))
    with sampler(smollm2) as s:
        s.set_adapter(second, alpha=trained_adapter.alpha)
        assert outcome(s.generate(request)) == after


def test_the_rank_padded_file_gives_llama_the_same_model(tmp_path, monkeypatch):
    """On a float32 base, where llama.cpp and torch agree to about 1e-5, the padded adapter and the
    exported one give the same logits as ours. (On a quantized base, llama.cpp quantizes the
    activations, so any float32 rounding change, such as the GEMM's summation order, can flip
    a rounding step: the two files' logits differ there as much as llama.cpp differs from us.)"""
    base = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    model = retrograd.load_model(base)
    adapter = attach_lora(model.transformer, ["auto"], rank=8, alpha=16.0, seed=0)
    randomise_b(adapter, 0.05)
    tensors, shapes = adapter_tensors(adapter), {n: t.shape for n, t in GGUFFile(base).tensors.items()}
    exported = write_adapter(tmp_path / "export.gguf", tensors, arch="llama", alpha=16.0, base_shapes=shapes)
    monkeypatch.setattr(live_adapter, "RANK_MULTIPLE", 16)  # padded on any CPU
    padded, alpha = padded_for_llama(tensors, 16.0)
    assert alpha == 32.0
    live = write_adapter(tmp_path / "live.gguf", padded, arch="llama", alpha=alpha, base_shapes=shapes)
    ids = list(range(5, 60))
    with torch.no_grad():
        ours = model.logits(ids)
        with adapter.disabled():
            assert (model.logits(ids) - ours).abs().max() > 0.1  # the adapter does something
    for file in (exported, live):  # arch_checks.assert_adapter_reproduced's bound for a float32 base
        assert (llama_logits(base, ids, lora_path=file) - ours).abs().max() <= 1e-3


@pytest.mark.parametrize("rank, padded", [(8, 16), (3, 16), (16, 16), (20, 32)])
def test_padding_the_rank_adds_zeros_and_keeps_alpha_over_r(rank, padded, monkeypatch):
    monkeypatch.setattr(live_adapter, "RANK_MULTIPLE", 16)  # AVX512's; AVX2 needs 8
    rng = np.random.default_rng(rank)

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32)

    tensors = {
        "blk.0.attn_q.weight": LoRAWeights(normal((rank, 12)), normal((10, rank))),
        "blk.0.ffn_up_exps.weight": LoRAWeights(normal((4, rank, 12)), normal((4, 7, rank))),
    }
    out, alpha = padded_for_llama(tensors, 2.0 * rank)
    assert alpha / padded == 2.0
    for name, w in tensors.items():
        a, b = out[name].a, out[name].b
        assert a.shape[-2] == b.shape[-1] == padded and a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a[..., :rank, :], w.a)
        np.testing.assert_array_equal(b[..., :rank], w.b)
        assert not a[..., rank:, :].any() and not b[..., rank:].any()
        np.testing.assert_allclose(b @ a, w.b @ w.a, rtol=1e-5, atol=1e-5)


def test_conversation_prefills_only_new_tokens_and_matches_a_fresh_prefill(smollm2, chat):
    sampling = Sampling(6)
    with sampler(smollm2, n_seq_max=4) as s:
        a, b = s.open([5, 6])
        first = chat("Pick a number.")
        turn1 = s.generate_turn([(a, first), (b, first)], sampling)
        assert s.stats.prefilled == len(first)  # shared, as in a group
        assert a.cached == tuple(first + turn1[0].tokens[:-1])  # the last sampled token is not resident
        observation = chat("Now double it.")
        second_a = first + turn1[0].tokens + observation
        second_b = first + turn1[1].tokens[:2] + observation  # diverges from what b's cache holds
        state_a, state_b = a.rng.bit_generator.state, b.rng.bit_generator.state
        turn2 = s.generate_turn([(a, second_a), (b, second_b)], sampling)
        assert turn2[0].reused == len(first) + len(turn1[0].tokens) - 1
        assert turn2[0].prefilled == len(observation) + 1
        assert turn2[1].reused + turn2[1].prefilled == len(second_b)
        assert len(first) <= turn2[1].reused <= len(first) + 2

        s.set_adapter(None)  # drops every cache: the next turn prefills everything
        a.rng.bit_generator.state, b.rng.bit_generator.state = state_a, state_b
        fresh = s.generate_turn([(a, second_a), (b, second_b)], sampling)
        assert [c.prefilled for c in fresh] == [len(second_a), len(second_b)]
        a.close()
        assert not a.open
        with pytest.raises(DataError, match="closed"):
            s.generate_turn([(a, second_a)], sampling)
    # The cache holds exactly what llama.cpp computes when it decodes the context in the pieces
    # the cache was built from (the shared prompt, then the sampled tokens one by one, then the
    # new tokens in one batch), and a fresh prefill what it computes in one batch. The two differ
    # in the last bits of their sums (with AVX2 llama.cpp's batched and one-token kernels sum in
    # different orders, which moved these log-probs by up to 0.17 on a Zen 3 and can flip a draw),
    # so each is compared with its own reference; a stale or misplaced KV entry is far off.
    for c, context in zip(turn2, (second_a, second_b)):
        pieces = [context[: len(first)], *([t] for t in context[len(first) : c.reused]), context[c.reused :]]
        np.testing.assert_allclose(c.logprobs, reference_logprobs(smollm2, context, c.tokens, pieces=pieces), atol=2e-4)
    for c, context in zip(fresh, (second_a, second_b)):
        np.testing.assert_allclose(c.logprobs, reference_logprobs(smollm2, context, c.tokens), atol=2e-4)
    wrong_context = reference_logprobs(smollm2, second_b, fresh[0].tokens)
    assert np.abs(wrong_context - fresh[0].logprobs).max() > 0.1


def test_bad_requests_are_one_line_errors(smollm2, chat):
    with sampler(smollm2, n_seq_max=2) as s:
        cases = [
            (GroupRequest(chat("hi"), [1], Sampling(N_CTX)), f"+ max_new_tokens {N_CTX} = "),
            (GroupRequest([], [1], Sampling(4)), "empty prompt"),
            (GroupRequest([1, 10**6], [1], Sampling(4)), "token id 1000000, outside the vocabulary"),
            (GroupRequest([1, 2], [], Sampling(4)), "no seeds"),
            (GroupRequest([1, 2], [-1], Sampling(4)), "seeds must be integers >= 0"),
        ]
        for request, message in cases:
            with pytest.raises(DataError) as e:
                s.generate([request])
            assert message in str(e.value) and "\n" not in str(e.value)
        s.open([1, 2])
        with pytest.raises(DataError, match="only 0 of 2 sequences are free"):
            s.open([3])
