"""`retrograd bench` on a real adapter: a short SFT run trains one on a tiny random llama,
then the bench must see it beat the base on its own training data, agree with llama.cpp's
log-probs example by example, and stop bad input with one line."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from chats import write_chat
from llama_ref import llama_logits
from rich.console import Console

import retrograd
from retrograd.cli.bench import table
from retrograd.config import load_config
from retrograd.data import ChatFormat, load_sft
from retrograd.evaluation import bench
from retrograd.gguf.adapter import LoRAWeights, read_adapter, write_adapter
from retrograd.recipes import sft
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]




def write_config(folder: Path, model: Path, output: str = "out/adapter.gguf") -> Path:
    cfg = folder / f"run-{Path(output).stem}.toml"
    cfg.write_text(
        f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
[output]
path = "{output}"
[lora]
rank = 4
alpha = 8.0
dtype = "f32"
[training]
ctx = 64
micro_batch = 96
gradient_accumulation = 2
lr = 5e-3
epochs = 2
compute_dtype = "f32"
threads = 2
[sft]
data = "train.jsonl"
"""
    )
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    """(folder, config path, adapter path) after a real 2-epoch SFT run on 24 sums."""
    folder = tmp_path_factory.mktemp("bench")
    write_chat(folder / "train.jsonl", 24, seed=0)
    write_chat(folder / "held_out.jsonl", 12, seed=1)
    cfg = write_config(folder, tiny_model("llama"))
    result = sft.run(load_config(cfg), SilentReporter())
    return folder, cfg, result.output


@pytest.fixture(scope="module")
def measured(trained):
    """The bench of the trained config as it stands: its training data, its output adapter."""
    return bench.run(load_config(trained[1]), SilentReporter())


def test_adapter_beats_the_base_on_its_training_data(trained, measured):
    result, adapter = measured, trained[2]
    assert result.adapter_path == adapter and result.examples == 24
    assert result.adapter.loss < result.base.loss
    verdict = result.verdict()
    assert verdict.label == "improved" and verdict.mean_delta > 0
    assert verdict.total == 24 and verdict.improved > verdict.degraded
    assert verdict.loss_percent < 0
    rows = {r.metric: r for r in result.rows()}
    assert rows["loss"].delta < 0 and rows["perplexity"].adapter == pytest.approx(np.exp(result.adapter.loss))
    assert rows["mean"].adapter == pytest.approx(np.mean(result.adapter.logprobs))
    assert rows["p50"].base == pytest.approx(float(np.median(result.base.logprobs)))


def reference_logprobs(model: Path, examples, lora_path=None) -> list[np.ndarray]:
    """llama.cpp's log-prob of each supervised token, example by example."""
    out = []
    for e in examples:
        logp = llama_logits(model, list(e.ids), lora_path=lora_path).double().log_softmax(-1)  # [T, V]
        ids, mask = torch.tensor(e.ids), torch.tensor(e.mask)
        picked = logp[:-1].gather(1, ids[1:, None])[:, 0]  # [T-1] log p(ids[i] | ids[:i])
        out.append(picked[mask[1:]].numpy())
    return out


def test_numbers_match_llama_cpp_on_the_first_n_examples(trained, tiny_model):
    folder, cfg, adapter = trained
    n = 4
    result = bench.run(load_config(cfg), SilentReporter(), bench.BenchOptions(limit=n))
    model = tiny_model("llama")
    base = retrograd.load_model(model)
    chat = ChatFormat(base.tokenizer, base.spec.chat_template)
    examples = load_sft(folder / "train.jsonl", chat, ctx=64).examples[:n]
    for side, lora in ((result.base, None), (result.adapter, adapter)):
        ref = reference_logprobs(model, examples, lora)
        assert side.supervised_tokens == sum(len(r) for r in ref)
        assert np.allclose(side.logprobs, [r.mean() for r in ref], atol=2e-3), (side.logprobs, [r.mean() for r in ref])
        assert side.loss == pytest.approx(-np.concatenate(ref).mean(), abs=2e-3)


def test_base_alone_when_the_output_adapter_is_absent(trained, measured, tiny_model):
    cfg = write_config(trained[0], tiny_model("llama"), output="missing/none.gguf")
    alone = bench.run(load_config(cfg), SilentReporter())
    assert alone.adapter is None and alone.adapter_path is None and alone.verdict() is None
    assert alone.base.logprobs == pytest.approx(measured.base.logprobs, abs=1e-6)
    assert alone.base.loss == pytest.approx(measured.base.loss, abs=1e-6)
    assert all(r.adapter is None for r in alone.rows())
    console = Console(record=True, width=120)
    console.print(table(alone.rows()))
    header = next(line for line in console.export_text().splitlines() if "metric" in line)
    assert [c.strip() for c in header.strip("│ ").split("│")] == ["metric", "base"]


def test_cli_prints_the_table_and_verdict_for_other_data(trained):
    folder, cfg, _ = trained
    r = subprocess.run(
        [*RETROGRAD, "bench", str(cfg), "--data", "held_out.jsonl", "--limit", "5", "--verbose"],
        cwd=folder,
        capture_output=True,
        check=False,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert f"5 example(s) from {folder / 'held_out.jsonl'}" in r.stdout
    lines = r.stdout.splitlines()
    per_example = next(i for i, line in enumerate(lines) if "example (mean logprob)" in line)
    cells = [[c.strip() for c in line.strip("│ ").split("│")] for line in lines[per_example : per_example + 7]]
    assert cells[0] == ["example (mean logprob)", "base", "adapter", "Δ"]
    assert [c[0] for c in cells[2:]] == [f"{folder / 'held_out.jsonl'}:{n}" for n in range(1, 6)]
    assert all(float(c[3]) == pytest.approx(float(c[2]) - float(c[1]), abs=2e-4) for c in cells[2:])
    header = next(line for line in lines if "metric" in line)
    assert [c.strip() for c in header.strip("│ ").split("│")] == ["metric", "base", "adapter", "Δ", "Δ%"]
    examples_row = next(line for line in lines if "  examples " in line)
    assert [c.strip() for c in examples_row.strip("│ ").split("│")][:3] == ["examples", "5", "5"]
    verdict = next(line for line in lines if line.startswith("verdict"))
    assert (
        verdict.split()[1] in ("improved", "degraded", "unchanged")
        and "mean logprob Δ" in verdict
        and "loss" in verdict
    )
    counts = next(line for line in lines if line.startswith("examples"))
    assert "/5 improved" in counts and "unchanged (|Δ| ≤ 0.001 nats/token)" in counts
    assert any(line.startswith("change/ex  mean Δ") and "worst Δ" in line for line in lines)


def rewritten_adapter(src: Path, dst: Path, *, arch: str = "llama", squeeze: str | None = None) -> Path:
    """A copy of `src` declaring `arch`, with `squeeze`'s A cut to half its inputs."""
    loaded = read_adapter(src)
    tensors = dict(loaded.tensors)
    if squeeze:
        w = tensors[squeeze]
        tensors[squeeze] = LoRAWeights(w.a[:, : w.a.shape[1] // 2], w.b)
    shapes = {n: (w.b.shape[0], w.a.shape[1]) for n, w in tensors.items()}
    return write_adapter(dst, tensors, arch=arch, alpha=loaded.alpha, base_shapes=shapes)


def write_grpo_config(folder: Path, model: Path) -> Path:
    cfg = folder / "grpo.toml"
    cfg.write_text(
        f"""
[run]
algorithm = "grpo"
[model]
path = "{model}"
[output]
path = "out/grpo.gguf"
[grpo]
prompts = "prompts.jsonl"
reward_command = ["python3", "reward.py"]
updates = 1
prompts_per_update = 1
group_size = 2
grpo_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
kl_coefficient = 0.0
[grpo.sampling]
max_new_tokens = 8
"""
    )
    return cfg


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing data", "--data"),
        ("missing adapter", "--adapter"),
        ("not an adapter", "not a LoRA adapter"),
        ("other architecture", "made for architecture 'qwen3', but the base model tiny-llama.gguf is 'llama'"),
        ("shapes do not fit", "does not fit the base model tiny-llama.gguf: adapter weight blk.0.attn_q.weight"),
        ("grpo config without held-out prompts", "grpo.toml: no held-out prompts to bench on"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(trained, tiny_model, tmp_path, case, needle):
    _, cfg, adapter = trained
    args = {
        "missing data": lambda: [cfg, "--data", tmp_path / "nope.jsonl"],
        "missing adapter": lambda: [cfg, "--adapter", tmp_path / "nope.gguf"],
        "not an adapter": lambda: [cfg, "--adapter", tiny_model("llama")],
        "other architecture": lambda: [cfg, "--adapter", rewritten_adapter(adapter, tmp_path / "a.gguf", arch="qwen3")],
        "shapes do not fit": lambda: [
            cfg,
            "--adapter",
            rewritten_adapter(adapter, tmp_path / "a.gguf", squeeze="blk.0.attn_q.weight"),
        ],
        "grpo config without held-out prompts": lambda: [write_grpo_config(tmp_path, tiny_model("llama"))],
    }[case]()
    r = subprocess.run([*RETROGRAD, "bench", *args], capture_output=True, text=True, check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "no such file" in lines[0] if case.startswith("missing") else "Traceback" not in r.stderr
