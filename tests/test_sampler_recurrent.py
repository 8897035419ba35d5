"""The rollout sampler on hybrid models whose conv layers keep a recurrent state per sequence
(lfm2, lfm2moe). llama.cpp copies such a state whole but cannot cut it back, so the sampler
never rewinds one (retrograd/sampler/sampler.py, "Recurrent models"): a group member copies
the prompt's stream only while it holds exactly the prompt, anything else is prefilled from
position 0, a stream that took a pad is emptied, and a conversation's turn is prefilled from
0. These tests hold it to our torch forward (live adapter on the conv projections too), to
bit-for-bit reproducibility whatever the other requests, and to one GRPO update."""

import pytest
import torch
from lora_files import randomise_b
from test_grpo import write_config
from test_sampler_architectures import ATOL, TEMPERATURE, _gap, _our_logprobs

import retrograd
from retrograd.config import load_config
from retrograd.model.lora import DEFAULT_TARGETS, attach_lora
from retrograd.recipes import grpo
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.sampler.sampler import PREFILL_CHUNK
from retrograd.training.report import SilentReporter

ARCHS = ["lfm2", "lfm2moe"]
CONV_PROJECTIONS = ["blk.*.shortconv.in_proj.weight", "blk.*.shortconv.out_proj.weight"]


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tiny_model):
    """(path, model, adapter): LoRA on every `auto` family and the conv projections, non-zero B."""
    path = tiny_model(request.param)
    model = retrograd.load_model(path)
    adapter = attach_lora(model.transformer, [*DEFAULT_TARGETS, *CONV_PROJECTIONS], rank=4, alpha=8.0, seed=0)
    assert any("shortconv" in name for name in adapter.layers)
    randomise_b(adapter)
    return path, model, adapter


def _sampler(hybrid, n_seq_max: int = 2, kv_dtype: str = "f32", n_threads: int = 1) -> Sampler:
    s = Sampler(hybrid[0], SamplerOptions(n_ctx=128, n_seq_max=n_seq_max, kv_dtype=kv_dtype, n_threads=n_threads))
    s.set_adapter(hybrid[2])
    return s


def _outcome(groups):
    return [[(c.tokens, c.logprobs, c.finish) for c in g] for g in groups]


def test_a_group_larger_than_the_streams_carries_our_logprobs(hybrid, ordinary_text):
    """Three members on two streams: two share the prefilled prompt, the third starts when
    the prompt's stream has moved on and prefills it again from position 0."""
    _, model, adapter = hybrid
    prompt = model.tokenize(ordinary_text)[:70]
    with _sampler(hybrid) as s:
        (group,) = s.generate([GroupRequest(prompt, [1, 2, 3], Sampling(30, temperature=TEMPERATURE))])
    assert [c.prefilled for c in group] == [70, 0, 70] and group[2].reused == 0
    assert _gap(model, prompt, group) <= ATOL
    with adapter.disabled():  # a sampler without the adapter would be far off
        assert _gap(model, prompt, group) > 30 * ATOL


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_completions_depend_on_seed_and_context_only(hybrid, ordinary_text, kv_dtype):
    """Each request alone vs all together, in reverse, and (on two threads) after a request
    that left a longer context with the same first piece in the cache: the same tokens and
    log-probs, bit for bit."""
    ids = hybrid[1].tokenize(ordinary_text)
    sampling = Sampling(12, temperature=TEMPERATURE)
    requests = [GroupRequest(ids[:70], [1, 2, 3], sampling), GroupRequest(ids[5:30], [4], sampling),
                GroupRequest(ids[:66], [5, 6], sampling)]
    with _sampler(hybrid, kv_dtype=kv_dtype) as s:
        alone = [_outcome(s.generate([r]))[0] for r in requests]
        together = _outcome(s.generate(requests))
        reversed_ = _outcome(s.generate(requests[::-1]))[::-1]
    with _sampler(hybrid, kv_dtype=kv_dtype, n_threads=2) as s:
        s.generate([GroupRequest(ids[:PREFILL_CHUNK + 20], [7], sampling)])
        groups = s.generate(requests)
    after = _outcome(groups)
    # nothing of the first request's stream was taken: only whole copies of a just-prefilled prompt
    assert [[c.reused for c in g] for g in groups] == [[0, 70, 0], [0], [0, 66]]
    assert together == alone and reversed_ == alone and after == alone
    assert len({tuple(c[0]) for g in alone for c in g}) > 1


def test_conversation_turns_are_a_fresh_prefill_of_their_history(hybrid, ordinary_text):
    """Three conversations on three streams; one waits (its stream takes pads) while the
    others take turns. Every turn's log-probs are our forward's over the whole history, and
    a conversation's turns are those it takes alone."""
    _, model, _ = hybrid
    ids = model.tokenize(ordinary_text)
    sampling = Sampling(8, temperature=TEMPERATURE)
    user = ids[100:104]

    def converse(s, conversation, history, turns):
        out = []
        for _ in range(turns):
            (c,) = s.generate_turn([(conversation, history)], sampling)
            out.append((history, c))
            history = history + c.tokens + user
        return out

    with _sampler(hybrid, n_seq_max=3) as s:
        (a,) = s.open([11])
        alone = converse(s, a, ids[:40], 3)
    with _sampler(hybrid, n_seq_max=3) as s:
        a, b, c = s.open([11, 12, 13])
        (c1,) = s.generate_turn([(c, ids[50:90])], sampling)
        beside, history = [], ids[:40]
        for turn in range(3):
            one, _ = s.generate_turn([(a, history), (b, ids[10:20] + user * turn)], sampling)
            beside.append((history, one))
            history = history + one.tokens + user
        (c2,) = s.generate_turn([(c, ids[50:90] + c1.tokens + user)], sampling)
    assert [(h, r.tokens, r.logprobs) for h, r in beside] == [(h, r.tokens, r.logprobs) for h, r in alone]
    assert all(r.reused == 0 and r.prefilled == len(h) for h, r in beside)
    turns = beside + [(ids[50:90], c1), (ids[50:90] + c1.tokens + user, c2)]
    for history, r in turns:
        ours = _our_logprobs(model, history, r.tokens, TEMPERATURE)
        assert (torch.tensor(r.logprobs) - ours).abs().max().item() <= ATOL


def test_one_grpo_update_on_lfm2(tmp_path, tiny_model):
    cfg = write_config(tmp_path, tiny_model("lfm2"), updates=1, reward_name="length",
                       training='compute_dtype = "f32"\nfast_sampling_context = false\nthreads = 1')
    cfg.write_text(cfg.read_text().replace("threads = 2\n", ""))
    result = grpo.run(load_config(cfg), SilentReporter())
    (record,) = result.records
    assert record.metrics["completions/length_mean"] > 0
    assert record.step_diagnostics[0]["policy/ratio_min"] == record.step_diagnostics[0]["policy/ratio_max"] == 1.0
    assert (tmp_path / "out/adapter.gguf").is_file()
