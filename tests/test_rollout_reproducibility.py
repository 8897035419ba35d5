"""Seeded rollouts repeat exactly on the CPU (issue 9, item 12).

llama.cpp computes a token row differently depending on the ubatch it lands in (one row or
several, how many query rows of its sequence, which sequence ids are consecutive; see
retrograd/sampler/sampler.py), so the sampler only hands it shapes that are a function of
one sequence. What that buys, and what these tests hold it to, bit for bit:
- a completion's tokens and log-probs depend on its seed and context only: not on the other
  requests, their order, the thread count, the llama_decode batch size or what the cache
  held before (the default suite, below);
- a conversation's turns depend on its seed and its own history only;
- a GRPO run killed with SIGKILL after its second checkpoint and resumed ends with the
  adapter, rollouts and metrics of the uninterrupted run (slow).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lora_files import randomise_b

import retrograd
from retrograd.gguf.adapter import adapter_tensors
from retrograd.model.lora import attach_lora
from retrograd.model.tokenizer import Tokenizer
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.sampler.sampler import PREFILL_CHUNK, _full_pieces_end, _last_piece_start, _pieces

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"
# A system message long enough that prompts cross the 64-token prefill piece boundary and
# share a whole piece, so cached prefixes are reused from one request (or call) to another.
SYSTEM = (
    "You are a careful calculator. Read the expression in the question, work it out step by step "
    "in your head, respect the usual precedence of multiplication and division over addition and "
    "subtraction, and then reply with the resulting integer only, without any words, units or "
    "punctuation around it."
)


def test_prefill_pieces_are_aligned_and_never_a_single_row():
    k = PREFILL_CHUNK
    assert _pieces(0, 2 * k + 5) == [(0, k), (k, 2 * k), (2 * k, 2 * k + 5)]
    assert _pieces(0, 2 * k + 1) == [(0, k), (k, 2 * k + 1)]  # a lone last token joins the piece before
    assert _pieces(k - 1, 2 * k + 1) == [(k - 1, 2 * k + 1)]  # and a lone first one the piece after
    assert _pieces(5, 7) == [(5, 7)] and _pieces(0, 1) == [(0, 1)]
    for start, end in [(0, 300), (3, 64), (63, 200), (64, 129), (100, 101)]:
        pieces = _pieces(start, end)
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(a == b for (_, a), (b, _) in zip(pieces, pieces[1:]))
        assert all(b - a >= 2 for a, b in pieces) or end - start == 1
        assert all(b % k == 0 for _, b in pieces[:-1]) and all(b - a <= k + 2 for a, b in pieces)
    # what a prefill of n tokens computes exactly as any longer context with those tokens does
    assert [_full_pieces_end(n) for n in (1, 63, 64, 65, 66, 129, 130)] == [0, 0, 64, 0, 64, 64, 128]
    assert [_last_piece_start(n) for n in (1, 63, 64, 65, 66, 129, 130)] == [0, 0, 0, 0, 64, 64, 128]


@pytest.fixture(scope="module")
def trained(smollm2):
    """(tensors, alpha) of a rank-8 LoRA on all seven families with non-zero B, as after
    some training: with it, a one-row ubatch is measurably not a many-row one."""
    adapter = attach_lora(retrograd.load_model(smollm2).transformer, ["auto"], rank=8, alpha=16.0, seed=0)
    randomise_b(adapter, 0.02)
    return adapter_tensors(adapter), adapter.alpha


@pytest.fixture(scope="module")
def requests(smollm2):
    tok = Tokenizer(smollm2)

    def chat(question: str, system: str | None) -> list[int]:
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return tok.encode(f"{head}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")

    questions = ["Calculate 2 + 3.", "Calculate 12 * 6.", "Calculate 81 / 9.", "Calculate 7 - 15."]
    out = [GroupRequest(chat(q, SYSTEM if i % 2 else None), [100 * i + j for j in range(2)], Sampling(6))
           for i, q in enumerate(questions)]
    assert min(len(r.prompt) for r in out) < PREFILL_CHUNK < max(len(r.prompt) for r in out)
    return out


def outcome(groups):
    return [[(c.tokens, c.logprobs, c.finish) for c in g] for g in groups]


def open_sampler(path, trained, kv_dtype, *, n_threads=2, n_batch=512):
    s = Sampler(path, SamplerOptions(n_ctx=160, n_seq_max=8, n_batch=n_batch, kv_dtype=kv_dtype, n_threads=n_threads))
    s.set_adapter(trained[0], alpha=trained[1])
    return s


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
def test_completions_depend_on_seed_and_context_only(smollm2, trained, requests, kv_dtype):
    """Each request alone vs all together, in reverse, after a call that left another
    prompt with the same system message in the cache, on one thread with a small
    llama_decode batch: the same tokens and log-probs, bit for bit."""
    with open_sampler(smollm2, trained, kv_dtype) as s:
        alone = [outcome(s.generate([r]))[0] for r in requests]
        together = outcome(s.generate(requests))
        reversed_ = outcome(s.generate(requests[::-1]))[::-1]
    with open_sampler(smollm2, trained, kv_dtype, n_threads=1, n_batch=8) as s:
        warm = GroupRequest(list(requests[1].prompt[:-3]) + [28, 29, 30], [7], Sampling(4))
        s.generate([warm])
        assert s.stats.reused == 0
        after = outcome(s.generate(requests))
        assert s.stats.reused >= 2 * PREFILL_CHUNK  # whole pieces of the shared system message were taken
    assert together == alone
    assert reversed_ == alone
    assert after == alone
    assert len({tuple(c[0]) for g in alone for c in g}) > 1


def test_conversation_turns_depend_on_its_own_history_only(smollm2, trained, requests):
    """A conversation alone, or opened after another one whose turn left the shared system
    message in the cache and which then takes its own next turn beside it: the same turns."""
    first, other = list(requests[1].prompt), list(requests[3].prompt)
    sampling = Sampling(6)

    def converse(with_neighbour: bool):
        with open_sampler(smollm2, trained, "f16") as s:
            if with_neighbour:
                a, b = s.open([11, 12])
                (b1,) = s.generate_turn([(b, other)], sampling)
                one = s.generate_turn([(a, first), (b, other + b1.tokens + first[-6:])], sampling)[0]
            else:
                (a,) = s.open([11])
                (one,) = s.generate_turn([(a, first)], sampling)
            (two,) = s.generate_turn([(a, first + one.tokens + first[-6:])], sampling)
            return outcome([[one, two]]), one.reused

    (alone, _), (beside, reused) = converse(False), converse(True)
    assert beside == alone
    assert reused == PREFILL_CHUNK  # the whole piece of the system message came from the other sequence


# ------------------------------------------------------------------ the killed-and-resumed run

def write_run(folder: Path) -> Path:  # -> folder, holding grpo.toml and its data
    """The smoke GRPO run (4 updates of 2 epochs, the example's persistent reward program,
    KL to the base, a held-out evaluation every 2 updates) in f32, with prompts behind a
    long system message and a step checkpoint after every update."""
    folder.mkdir()
    data = {}
    for name, source, count in (("train", "smoke_rl_prompts.jsonl", 8), ("eval", "smoke_rl_eval.jsonl", 4)):
        lines = (EXAMPLES / "data" / source).read_text().splitlines()[:count]
        with open(folder / f"{name}.jsonl", "w") as f:
            for line in lines:
                messages = [{"role": "system", "content": SYSTEM}, *json.loads(line)["messages"]]
                f.write(json.dumps({"messages": messages}) + "\n")
        data[name] = folder / f"{name}.jsonl"
    config = folder / "grpo.toml"
    config.write_text(f"""
[run]
algorithm = "grpo"
[output]
path = "out/adapter.gguf"
[lora]
rank = 8
alpha = 16.0
dtype = "f32"
[training]
ctx = 160
micro_batch = 512
lr = 2e-4
weight_decay = 0.01
compute_dtype = "f32"
threads = 2
[grpo]
prompts = "{data['train']}"
reward_command = ["{sys.executable}", "{EXAMPLES / 'smoke_rl_reward.py'}"]
updates = 4
prompts_per_update = 2
group_size = 4
grpo_epochs = 2
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.02
[grpo.sampling]
max_new_tokens = 8
[evaluation]
data = "{data['eval']}"
every_iterations = 2
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 2
""")
    return folder


def train(folder: Path, *extra: str, wait: bool = True):
    """`retrograd train grpo.toml` in `folder` with this checkout's package; its output goes
    to folder/train-N.log."""
    log = folder / f"train-{len(list(folder.glob('train-*.log')))}.log"
    command = [sys.executable, "-m", "retrograd", "train", "grpo.toml", *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=folder, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=out, stderr=subprocess.STDOUT)
    if not wait:
        return proc, log
    assert proc.wait() == 0, log.read_text()[-3000:]
    return log.read_text()


WALL_CLOCK = ("time", "train/tokens_per_second", "sampler/adapter_refresh_seconds")


def per_update(path: Path, key: str = "update") -> dict[int, list]:
    """Records by `key`, keeping the last block of each (a killed run may have written part
    of what the resumed run writes again), without the wall-clock fields."""
    blocks: dict[int, list] = {}
    previous = None
    for line in path.read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items()
                  if k not in WALL_CLOCK and not k.startswith(("timing/", "system/"))}
        if "source" in record:  # the prompt file's path, which names the run's folder
            record["source"] = Path(record["source"]).name
        if record[key] != previous:
            blocks[record[key]] = []
        blocks[record[key]].append(record)
        previous = record[key]
    return blocks


@pytest.mark.slow
def test_run_killed_after_its_second_checkpoint_resumes_bit_for_bit(tmp_path):
    straight = write_run(tmp_path / "straight")
    t0 = time.perf_counter()
    train(straight)
    print(f"uninterrupted run: {time.perf_counter() - t0:.0f} s")

    killed = write_run(tmp_path / "killed")
    second = killed / "ckpt/step-000000000004.state/manifest.json"  # after update 2 (2 optimizer steps each)
    t0 = time.perf_counter()
    proc, log = train(killed, wait=False)
    deadline = time.time() + 900
    while proc.poll() is None and not second.exists() and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, log.read_text()[-3000:]
    assert second.exists() and not (killed / "ckpt/step-000000000006.state").exists()
    print(f"killed with SIGKILL {time.perf_counter() - t0:.0f} s in, right after {second.parent.name}")
    resumed = train(killed, "--resume")
    assert "resumed from" in resumed and f"{second.parent.name} at update 2" in resumed, resumed[-3000:]

    final = (straight / "out/adapter.gguf").read_bytes()
    assert (killed / "out/adapter.gguf").read_bytes() == final
    for name in ("step-000000000006.gguf", "step-000000000008.gguf"):
        assert (killed / "ckpt" / name).read_bytes() == (straight / "ckpt" / name).read_bytes(), name
    rollouts = per_update(straight / "out/adapter.rollouts.jsonl")
    assert sorted(rollouts) == [1, 2, 3, 4]
    assert per_update(killed / "out/adapter.rollouts.jsonl") == rollouts  # completions, ids, sampler and policy log-probs
    # the uninterrupted run samples update 3 right after the held-out evaluation, which
    # leaves the shared system message in the cache; the resumed one starts cold
    assert all(r["prompt_ids"][:8] == rollouts[3][0]["prompt_ids"][:8] for r in rollouts[3])
    metrics = per_update(straight / "out/adapter.metrics.jsonl", "step")
    assert per_update(killed / "out/adapter.metrics.jsonl", "step") == metrics
