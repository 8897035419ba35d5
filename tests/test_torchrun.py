"""Data-parallel training under torchrun on the CPU (gloo): a 2-rank run takes the steps of
the 1-rank run with the same global batch.

Each rank backpropagates its share of a step's micro-batches and the LoRA gradients are
summed, so the two runs differ only in the order of float sums. Measured on a 2-core AMD
EPYC (f32): SFT losses and gradient norms over 4 steps of 4 micro-batches within 8.4e-8
relative; GRPO's and agentic GRPO's updates (one group per rank, two optimizer steps)
bit-identical, losses and trained adapters alike, since a sum of two partial gradients is the
same float whichever side adds it. The bound, 1e-4 relative, leaves > 1000x room; without
the all-reduce the SFT, GRPO and agentic GRPO tests fail (checked).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_grpo import write_config

from retrograd.gguf.adapter import read_adapter

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
RETROGRAD = [sys.executable, "-m", "retrograd"]
BOUND = 1e-4  # relative; see the module docstring
pytestmark = pytest.mark.slow  # 12-17 s each on 2 cores: a 2-rank torchrun and a 1-rank run


def train(folder: Path, ranks: int) -> subprocess.CompletedProcess:
    command = [*TORCHRUN, f"--nproc_per_node={ranks}", "-m", "retrograd", "train", "run.toml"] if ranks > 1 else [*RETROGRAD, "train", "run.toml"]
    r = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "out/adapter.metrics.jsonl").read_text().splitlines()]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= BOUND * max(abs(a), abs(b), 1e-6)


def sft_config(folder: Path, model: Path) -> None:
    lines = [json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                      {"role": "assistant", "content": f"{2 * i}, since {i} plus {i} is {2 * i}."}]})
             for i in range(16)]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "run.toml").write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
dtype = "f32"
[training]
ctx = 64
micro_batch = 64
gradient_accumulation = 4
lr = 1e-3
compute_dtype = "f32"
threads = 1
[sft]
data = "train.jsonl"
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 2
""")


def test_sft_on_two_ranks_takes_the_one_rank_steps(tmp_path, tiny_model):
    model = tiny_model("llama")
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        sft_config(tmp_path / name, model)
    train(tmp_path / "one", 1)
    two = train(tmp_path / "two", 2)
    one_rows, two_rows = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert len(one_rows) == len(two_rows) == 4
    for a, b in zip(one_rows, two_rows):
        assert close(a["train/loss"], b["train/loss"]), (a["train/loss"], b["train/loss"])
        assert close(a["train/grad_norm"], b["train/grad_norm"]), (a["train/grad_norm"], b["train/grad_norm"])
    # rank 0 alone reports and writes: one summary line, one set of checkpoints, the adapter
    assert two.stdout.count("done epoch=1 step=4") == 1
    assert sorted(p.name for p in (tmp_path / "two/ckpt").iterdir() if p.suffix == ".state") == [
        "step-000000000002.state", "step-000000000004.state"]
    assert (tmp_path / "two/out/adapter.gguf").is_file()


@pytest.mark.slow  # ~19 s: the default suite keeps SFT and GRPO on two ranks
def test_sft_resumes_under_torchrun(tmp_path, tiny_model):
    sft_config(tmp_path, tiny_model("llama"))
    train(tmp_path, 2)
    first = rows(tmp_path)
    r = subprocess.run([*TORCHRUN, "--nproc_per_node=2", "-m", "retrograd", "train", "run.toml",
                        "--resume-from", "ckpt/step-000000000002.state"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = rows(tmp_path)[-2:]  # steps 3 and 4 again, from the step-2 checkpoint
    assert [row["step"] for row in resumed] == [3, 4]
    for a, b in zip(first[2:], resumed):
        assert a["train/loss"] == b["train/loss"]


def test_dpo_on_two_ranks_takes_the_one_rank_steps(tmp_path, tiny_model):
    """Preference training: each rank scores its share of a step's pairs; the summed gradients
    give the one-rank step, and the metrics (summed across ranks) the one-rank metrics."""
    model = tiny_model("llama")
    pairs = [{"prompt": f"Question {i}: is {i} even?", "chosen": " yes" if i % 2 == 0 else " no",
              "rejected": " no" if i % 2 == 0 else " yes"} for i in range(8)]
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        (folder / "run.toml").write_text(f"""
[run]
algorithm = "preference"
[model]
path = "{model}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
dtype = "f32"
[training]
ctx = 64
micro_batch = 16
lr = 1e-3
compute_dtype = "f32"
threads = 1
[preference]
data = "pairs.jsonl"
pairs_per_step = 4
""")
    train(tmp_path / "one", 1)
    two = train(tmp_path / "two", 2)
    one_rows, two_rows = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert len(one_rows) == len(two_rows) == 2
    for a, b in zip(one_rows, two_rows):
        for key in ("train/loss", "train/grad_norm", "rewards/margins", "logps/chosen"):
            assert close(a[key], b[key]), (key, a[key], b[key])
    assert one_rows[1]["train/loss"] != one_rows[0]["train/loss"]
    assert two.stdout.count("done epoch=1 step=2") == 1 and (tmp_path / "two/out/adapter.gguf").is_file()


def test_grpo_on_two_ranks_takes_the_one_rank_update(tmp_path, tiny_model):
    """Rank 0 samples; both ranks train on its rollouts, one group's micro-batch each."""
    model = tiny_model("llama")
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        cfg = write_config(folder, model, updates=1, training='compute_dtype = "f32"', reward_name="length")
        text = cfg.read_text().replace("threads = 2", "threads = 1").replace("micro_batch = 256", "micro_batch = 100")
        cfg.write_text(text.replace("grpo_epochs = 1", "grpo_epochs = 2"))
        cfg.rename(folder / "run.toml")
    train(tmp_path / "one", 1)
    train(tmp_path / "two", 2)
    (a,), (b,) = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert a["reward/mean"] == b["reward/mean"]  # the same rollouts (rank 0 sampled them as one rank does)
    assert a["train/steps"] == b["train/steps"] == 2
    for key in ("policy/total_loss", "policy/ratio_min", "policy/ratio_max", "policy/logprob_mismatch_abs_mean"):
        assert close(a[key], b[key]), (key, a[key], b[key])
    assert a["batch/trained_tokens"] == b["batch/trained_tokens"]
    one_rollouts = [json.loads(line) for line in (tmp_path / "one/out/adapter.rollouts.jsonl").read_text().splitlines()]
    two_rollouts = [json.loads(line) for line in (tmp_path / "two/out/adapter.rollouts.jsonl").read_text().splitlines()]
    assert len(one_rollouts) == len(two_rollouts) == 8
    for x, y in zip(one_rollouts, two_rollouts):
        assert x["completion_ids"] == y["completion_ids"]
        assert all(close(p, q) for p, q in zip(x["policy_logprobs"], y["policy_logprobs"]))


@pytest.mark.slow  # ~19 s: the default suite keeps SFT and GRPO on two ranks
def test_on_policy_distillation_on_two_ranks_takes_the_one_rank_update(tmp_path, tiny_model):
    """Rank 0 alone holds the sampler and the teacher; the teacher's scores travel with the batch."""
    from test_distill import write_config as write_distill

    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        cfg = write_distill(folder, tiny_model("llama"), tiny_model("qwen2"), updates=1, distill_keys="distill_epochs = 2")
        cfg.write_text(cfg.read_text().replace("threads = 2", "threads = 1").replace("micro_batch = 256", "micro_batch = 60"))
        cfg.rename(folder / "run.toml")
    train(tmp_path / "one", 1)
    train(tmp_path / "two", 2)
    (a,), (b,) = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert a["distill/teacher_kl_mean"] == b["distill/teacher_kl_mean"]  # the same completions, scored once by rank 0
    for key in ("train/loss", "policy/ratio_min", "policy/ratio_max"):
        assert close(a[key], b[key]), (key, a[key], b[key])


@pytest.mark.slow  # ~19 s: the default suite keeps SFT and GRPO on two ranks
def test_agent_grpo_on_two_ranks_takes_the_one_rank_update(tmp_path, tiny_model):
    """Judge-only agentic GRPO: rank 0 collects and judges the trajectories, both ranks train.
    A micro-batch holds one group (25 prompt + 4 x 24 completion tokens fit 128, two groups do
    not), so each rank backpropagates one group, two optimizer steps. Step 1's loss is 0
    (ratio 1, equal lengths, centred advantages) but its gradient is not; step 2's loss and
    the trained adapter carry both ranks' gradients, so both differ without the all-reduce."""
    from test_agent_grpo import JUDGED, write_run

    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        cfg = write_run(folder, model=tiny_model("llama"), updates=1, scenarios_per_update=2, scenarios=(JUDGED,),
                        environment="", agent="temperature = 0.7")
        text = cfg.read_text().replace("[agent.environment]\n\n[agent.environment.tools]\ndefault = \"mini\"\n"
                                       "[agent.environment.tools.toolset.mini]\ntools = [\"write_file\", \"submit\"]\n", "")
        text = text.replace("threads = 2", 'threads = 1\ncompute_dtype = "f32"').replace("micro_batch = 4096", "micro_batch = 128")
        cfg.write_text(text.replace("epochs_per_update = 1", "epochs_per_update = 2").replace("[run]\n", "[run]\nverbose = true\n"))
        cfg.rename(folder / "run.toml")
    one = train(tmp_path / "one", 1)
    two = train(tmp_path / "two", 2)
    assert "step 2 micro-batch 2/2: 4 sequences" in one.stdout  # one group per micro-batch
    assert "step 2 micro-batch 1/1: 4 sequences" in two.stdout  # rank 0 trains one group, rank 1 the other
    (a,), (b,) = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert a["reward/mean"] == b["reward/mean"] and a["reward/std"] > 0 and a["train/steps"] == b["train/steps"] == 2
    assert abs(a["policy/total_loss"]) > 1e-2  # step 2's (measured -0.17; step 1's is 0)
    assert close(a["policy/total_loss"], b["policy/total_loss"]), (a["policy/total_loss"], b["policy/total_loss"])
    trained = [read_adapter(tmp_path / name / "out/adapter.gguf").tensors for name in ("one", "two")]
    assert trained[0].keys() == trained[1].keys()
    for name, one_rank in trained[0].items():
        two_ranks = trained[1][name]
        assert np.abs(one_rank.b).max() > 0  # B starts at zero: the steps moved it
        for part in ("a", "b"):
            x, y = getattr(one_rank, part), getattr(two_ranks, part)
            assert np.abs(x - y).max() <= BOUND * np.abs(x).max(), (name, part, np.abs(x - y).max(), np.abs(x).max())
