"""Every accepted config key does something, or is refused on one line naming it; the Rust
retrograd's keys that have nothing to do here run with a note."""

import subprocess
import sys
from pathlib import Path

import pytest

from retrograd.config import parse_config
from retrograd.errors import ConfigError
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
SAMPLING = {"max_new_tokens": 8}
GRPO = {"prompts": "p.jsonl", "reward_function": "r.py:f", "updates": 2, "prompts_per_update": 2, "group_size": 4,
        "grpo_epochs": 1, "clip_range_low": 0.2, "clip_range_high": 0.28, "kl_coefficient": 0.0, "sampling": SAMPLING}
AGENT = {"scenarios": "s.jsonl", "judge": {"command": ["judge"]}}
ON_POLICY = {"teacher_path": "t.gguf", "prompts": "p.jsonl", "updates": 2, "prompts_per_update": 2, "sampling": SAMPLING}
OFFLINE = {"mode": "topk_offline", "teacher_path": "t.gguf", "data": "train.jsonl"}


def config(algorithm: str, section: dict, **tables) -> dict:
    own = {"grpo": "grpo", "agent_grpo": "agent", "distill": "distill"}[algorithm]
    return {"run": {"algorithm": algorithm}, "output": {"path": "out/a.gguf"}, own: section} | tables


def problem(doc: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(doc, Path("/tmp/run.toml"))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "doc,needle",
    [
        (config("grpo", GRPO | {"sampling": SAMPLING | {"top_p": 0.9}}),
         "grpo.sampling.top_p = 0.9: training rollouts must be sampled from the whole tempered distribution"),
        (config("agent_grpo", AGENT | {"top_p": 0.95}), "agent.top_p = 0.95: training rollouts must be sampled"),
        (config("agent_grpo", AGENT | {"collect_api": {"base_url": "localhost:8080", "model": "m"}}),
         "agent.collect_api.base_url: 'localhost:8080' is not an http(s):// URL"),
        (config("agent_grpo", AGENT | {"collect_api": {"base_url": "http://127.0.0.1:8080/v1"}}), "agent.collect_api.model"),
        (config("distill", ON_POLICY | {"sampling": SAMPLING | {"top_p": 0.5}}), "distill.sampling.top_p = 0.5"),
        (config("grpo", GRPO, training={"epochs": 3}), "training.epochs does not apply to grpo: set grpo.grpo_epochs"),
        (config("agent_grpo", AGENT, training={"epochs": 2}), "set agent.epochs_per_update"),
        (config("distill", OFFLINE, training={"epochs": 2}), "distill.offline_epochs"),
        (config("grpo", GRPO, training={"gradient_accumulation": 2}), "training.gradient_accumulation does not apply to grpo"),
        (config("distill", ON_POLICY, training={"gradient_accumulation": 2}), "training.gradient_accumulation does not apply to distill"),
        (config("distill", ON_POLICY | {"topk": 8}), "distill.topk applies to loss = 'jsd'"),
        (config("distill", ON_POLICY | {"jsd_beta": 0.3}), "distill.jsd_beta applies to loss = 'jsd'"),
        (config("distill", ON_POLICY | {"loss": "jsd", "tis_cap": 2.0}), "distill.tis_cap applies to loss = 'reverse_kl'"),
        (config("distill", OFFLINE | {"tis_cap": 2.0}), "distill.tis_cap applies to mode = on_policy, not topk_offline"),
        (config("grpo", GRPO, training={"require_gpu_resident": True}, model={"device": "cpu"}),
         "training.require_gpu_resident = true with model.device = 'cpu'"),
    ],
)
def test_keys_that_would_do_nothing_are_refused(doc, needle):
    assert needle in problem(doc)


def test_nucleus_sampling_is_accepted_with_truncated_importance_sampling():
    cfg = parse_config(config("grpo", GRPO | {"tis_cap": 2.0, "sampling": SAMPLING | {"top_p": 0.9}}), Path("/tmp/run.toml"))
    assert cfg.grpo.sampling.top_p == 0.9 and cfg.grpo.tis_cap == 2.0


def test_offline_distillation_takes_gradient_accumulation_and_a_default_sidecar():
    cfg = parse_config(config("distill", OFFLINE, training={"gradient_accumulation": 4}), Path("/work/x/run.toml"))
    assert cfg.training.gradient_accumulation == 4
    assert cfg.distill.sidecar == Path("/work/x/train.topk")
    explicit = parse_config(config("distill", OFFLINE | {"sidecar": "s.topk"}), Path("/work/x/run.toml"))
    assert explicit.distill.sidecar == Path("/work/x/s.topk")


def test_jsd_keys_are_accepted_with_the_jsd_loss():
    cfg = parse_config(config("distill", ON_POLICY | {"loss": "jsd", "topk": 8, "jsd_beta": 0.3}), Path("/tmp/run.toml"))
    assert (cfg.distill.topk, cfg.distill.jsd_beta) == (8, 0.3)


def test_rust_retrograd_keys_without_a_meaning_here_run_with_a_note():
    doc = config("grpo", GRPO, training={"master_weights": "f32", "shared_prefix_fanout": "auto", "lr": 2e-4})
    cfg = parse_config(doc, Path("/tmp/run.toml"))
    assert cfg.training.lr == 2e-4
    assert [n.split(" ")[0] for n in cfg.notes] == ["training.master_weights", "training.shared_prefix_fanout"]
    assert all("accepted and ignored" in n for n in cfg.notes)
    assert "training.master_wieghts: unknown key" in problem(config("grpo", GRPO, training={"master_wieghts": "f32"}))
    assert parse_config(config("grpo", GRPO), Path("/tmp/run.toml")).notes == ()


def test_require_gpu_resident_stops_a_cpu_run_before_training(tmp_path, tiny_model):
    """On a machine without a GPU, device auto resolves to the CPU: exit 2, one line, nothing written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nalgorithm = "sft"\n[model]\npath = "{tiny_model("llama")}"\n[output]\npath = "out/a.gguf"\n'
                   '[training]\nrequire_gpu_resident = true\n[sft]\ndata = "train.jsonl"\n')
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "training.require_gpu_resident = true, but torch sees no CUDA GPU" in lines[0]
    assert not (tmp_path / "out/a.gguf").exists()


class Lines(SilentReporter):
    """A reporter that keeps its messages."""

    def __init__(self):
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


@pytest.mark.parametrize("verbose", [True, False])
def test_run_verbose_prints_micro_batch_and_phase_lines(tmp_path, tiny_model, verbose):
    from test_grpo import write_config

    from retrograd.config import load_config
    from retrograd.recipes import grpo

    cfg = write_config(tmp_path, tiny_model("llama"), reward_name="length")
    text = cfg.read_text().replace("micro_batch = 256", "micro_batch = 40")
    cfg.write_text(text.replace('algorithm = "grpo"', f'algorithm = "grpo"\nverbose = {str(verbose).lower()}'))
    reporter = Lines()
    result = grpo.run(load_config(cfg), reporter)
    micro = [line for line in reporter.lines if " micro-batch " in line]
    phases = [line for line in reporter.lines if " phases: " in line]
    if not verbose:
        assert micro == [] and phases == []
        return
    assert len(phases) == 2 and all("generation" in p and "optimizer" in p and "reward" in p for p in phases)
    assert len(micro) > result.steps  # micro_batch = 40 tokens cuts each step's 8 completions into several passes
    assert micro[0].startswith("step 1 micro-batch 1/") and "scored tokens" in micro[0]
