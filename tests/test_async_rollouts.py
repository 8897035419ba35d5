"""Asynchronous rollouts (training.max_async_rollout) and timeline.jsonl, on a tiny llama
sampled by the real llama.cpp: the staleness bound, what the first update shares with a
synchronous run, reproducibility at N = 1, evaluation through the producer thread, errors
raised in the producer, resume, and the keys that cannot apply."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_grpo import metrics, one_line_error, write_config

from retrograd.config import load_config
from retrograd.recipes import grpo
from retrograd.reports.timeline import timeline_summary
from retrograd.training.report import SilentReporter
from retrograd.training.timeline import TIMELINE_COUNTERS, read_timeline

RETROGRAD = [sys.executable, "-m", "retrograd"]


def run_grpo(tmp: Path, model: Path, *, ahead: int, updates: int = 4, extra: str = "", reward: str | None = None,
             grpo_extra: str = ""):
    training = f'compute_dtype = "f32"\ngeneration_threads = 1\nmax_async_rollout = {ahead}'
    cfg = one_thread(write_config(tmp, model, updates=updates, training=training, reward_name="length", extra=extra,
                                  reward=reward, grpo_extra=grpo_extra))
    return grpo.run(load_config(cfg), SilentReporter())


def one_thread(cfg: Path) -> Path:
    """One torch thread beside one llama.cpp thread: the two sides share the 2 cores."""
    cfg.write_text(cfg.read_text().replace("threads = 2", "threads = 1"))
    return cfg


def update_rows(path: Path) -> list[dict]:
    return [r for r in metrics(path) if "reward/mean" in r]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("async")
    result = run_grpo(tmp, tiny_model("llama"), ahead=1)
    return tmp, result


def test_batches_are_never_staler_than_the_bound(async_run):
    tmp, result = async_run
    rows = update_rows(tmp / "out/adapter.metrics.jsonl")
    assert result.updates_done == 4 and len(rows) == 4
    # update 1 samples with the initial adapter; every later one with the adapter one update old
    assert [r["rollouts/staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(r["rollouts/canceled"] == 0 for r in rows)


def test_the_timeline_has_both_sides_and_counters_per_update(async_run):
    tmp, _ = async_run
    spans, counters = read_timeline(tmp / "out/adapter.timeline.jsonl")
    assert sorted(counters) == [1, 2, 3, 4] and set(counters[1]) == set(TIMELINE_COUNTERS)
    by_side = {(s["worker"], s["phase"]) for s in spans}
    assert {("sampler", "generation"), ("sampler", "reward"), ("sampler", "adapter_refresh"),
            ("trainer", "optimizer"), ("trainer", "adapter_push"), ("trainer", "waiting_for_batch")} <= by_side
    assert all(s["end"] >= s["start"] >= 0 for s in spans)
    # the sampler produced update 2 while the trainer trained update 1: their spans overlap
    generation_2 = next(s for s in spans if s["update"] == 2 and s["phase"] == "generation")
    optimizer_1 = next(s for s in spans if s["update"] == 1 and s["phase"] == "optimizer")
    assert generation_2["start"] < optimizer_1["end"] and optimizer_1["start"] < generation_2["end"]
    truncated = [sum(r["truncated"] for r in metrics(tmp / "out/adapter.rollouts.jsonl") if r["update"] == u) for u in (1, 2, 3, 4)]
    assert [counters[u]["truncated_rollouts"] for u in (1, 2, 3, 4)] == truncated
    lines = timeline_summary(tmp / "out/adapter.timeline.jsonl")
    assert lines[0].startswith("Timeline (adapter.timeline.jsonl, 4 updates") and lines[-1].strip().startswith(("bottleneck:", "balanced:"))


def test_first_update_equals_the_synchronous_run_and_n1_is_reproducible(async_run, tmp_path, tiny_model):
    """Update 1 samples with the same (initial) adapter in both modes, so its rollouts are the
    same, and so is its loss once the synchronous run sets the cap the asynchronous one gets by
    default; later updates differ (they sample one adapter behind). At N = 1 the producer always
    samples update u with the adapter of update u - 1, so a second run repeats the first."""
    tmp, _ = async_run
    model = tiny_model("llama")
    (tmp_path / "sync").mkdir()
    (tmp_path / "again").mkdir()
    run_grpo(tmp_path / "sync", model, ahead=0, grpo_extra="tis_cap = 2.0")
    run_grpo(tmp_path / "again", model, ahead=1)
    first = metrics(tmp / "out/adapter.rollouts.jsonl")
    sync = metrics(tmp_path / "sync/out/adapter.rollouts.jsonl")
    again = metrics(tmp_path / "again/out/adapter.rollouts.jsonl")
    ids = lambda rows, u: [r["completion_ids"] for r in rows if r["update"] == u]
    assert ids(first, 1) == ids(sync, 1)
    assert any(ids(first, u) != ids(sync, u) for u in (2, 3, 4))
    without_paths = lambda rows: [{k: v for k, v in r.items() if k != "source"} for r in rows]
    assert without_paths(first) == without_paths(again)
    assert update_rows(tmp / "out/adapter.metrics.jsonl")[0]["policy/total_loss"] == update_rows(tmp_path / "sync/out/adapter.metrics.jsonl")[0]["policy/total_loss"]


def test_evaluation_runs_through_the_producer(tmp_path, tiny_model):
    result = run_grpo(tmp_path, tiny_model("llama"), ahead=2, updates=3,
                      extra='[evaluation]\ndata = "prompts.jsonl"\nmax_examples = 3\nevery_iterations = 1')
    rows = metrics(tmp_path / "out/adapter.metrics.jsonl")
    evals = [r for r in rows if "eval/mean_reward" in r]
    assert result.updates_done == 3 and [r["train/update"] for r in evals] == [1, 2, 3]
    assert max(r["rollouts/staleness"] for r in update_rows(tmp_path / "out/adapter.metrics.jsonl")) <= 2


def test_an_error_in_the_producer_stops_the_run_on_one_line(tmp_path, tiny_model):
    (tmp_path / "bad.py").write_text("def reward(prompts, completions):\n    return [0.0] * (len(completions) - 1)\n")
    cfg = one_thread(write_config(tmp_path, tiny_model("llama"), training="max_async_rollout = 1",
                                  reward=f'reward_function = "{tmp_path / "bad.py"}:reward"'))
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    one_line_error(r, "bad.py")


@pytest.mark.slow  # 11-13 s on 2 cores: a killed asynchronous run resumed
def test_resume_under_async_restarts_the_producer_and_says_so(tmp_path, tiny_model):
    """From the checkpoint after update 2 the run goes on at update 3, with the producer
    restarted on the checkpointed adapter (so update 3 samples with staleness 0 this time)."""
    one_thread(write_config(tmp_path, tiny_model("llama"), updates=3, reward_name="length",
                            training='compute_dtype = "f32"\nmax_async_rollout = 1',
                            extra='[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 1'))
    first = subprocess.run([*RETROGRAD, "train", "grpo.toml"], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert first.returncode == 0, first.stderr
    note = "note: training.max_async_rollout = 1 without grpo.tis_cap: using grpo.tis_cap = 2"
    assert note in first.stdout + first.stderr
    assert [r["rollouts/staleness"] for r in update_rows(tmp_path / "out/adapter.metrics.jsonl")] == [0, 1, 1]
    r = subprocess.run([*RETROGRAD, "train", "grpo.toml", "--resume-from", "ckpt/step-000000000002.state"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert "max_async_rollout = 1: sampling restarts at update 3 with the checkpointed adapter" in r.stdout + r.stderr
    rows = update_rows(tmp_path / "out/adapter.metrics.jsonl")
    assert [(row["train/update"], row["rollouts/staleness"]) for row in rows] == [(1, 0), (2, 1), (3, 1), (3, 0)]
    assert read_timeline(tmp_path / "out/adapter.timeline.jsonl")[1][3]["in_flight_rollouts"] == 0  # the resumed run's update 3


@pytest.mark.parametrize("algorithm,needle", [
    ("sft", "training.max_async_rollout applies to rollout algorithms (ppo, grpo, agent_grpo, distill), not sft"),
    ("offline", "training.max_async_rollout applies to rollout algorithms; distill mode 'topk_offline' samples nothing"),
])
def test_max_async_rollout_where_nothing_is_sampled_is_refused(tmp_path, algorithm, needle):
    section = ('[run]\nalgorithm = "sft"\n[sft]\ndata = "d.jsonl"\n' if algorithm == "sft" else
               '[run]\nalgorithm = "distill"\n[distill]\nmode = "topk_offline"\nteacher_path = "t.gguf"\ndata = "d.jsonl"\n')
    (tmp_path / "run.toml").write_text(section + '[output]\npath = "out/a.gguf"\n[training]\nmax_async_rollout = 1\n')
    r = subprocess.run([*RETROGRAD, "train", "run.toml"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    one_line_error(r, needle)


def test_timeline_of_a_synchronous_run_names_the_larger_side(tmp_path, tiny_model):
    run_grpo(tmp_path, tiny_model("llama"), ahead=0, updates=2)
    spans, counters = read_timeline(tmp_path / "out/adapter.timeline.jsonl")
    assert {s["worker"] for s in spans} == {"sampler", "trainer"}
    assert all(c["waiting_for_batch_seconds"] == 0 and c["in_flight_rollouts"] == 0 for c in counters.values())
    verdict = timeline_summary(tmp_path / "out/adapter.timeline.jsonl")[-1]
    assert "taking turns: max_async_rollout = 0" in verdict
    json.dumps(verdict)


def run_distill(tmp: Path, tiny_model, *, ahead: int, distill_keys: str = ""):
    """Three updates of tests/test_distill.py's tiny llama pair; weight_clip 30 never binds, so
    every advantage keeps its student term. Returns the config, the update rows and the
    rollout records."""
    from test_distill import write_config as write_distill

    from retrograd.recipes import distill

    cfg = one_thread(write_distill(tmp, tiny_model("llama"), tiny_model("llama", seed=1), updates=3,
                                   distill_keys=f"weight_clip = 30.0\n{distill_keys}"))
    training = f"max_async_rollout = {ahead}\ngeneration_threads = 1\n"
    cfg.write_text(cfg.read_text().replace("[distill]", training + "[distill]"))
    config = load_config(cfg)
    result = distill.run(config, SilentReporter())
    assert result.updates_done == result.steps == 3
    rows = [r for r in metrics(tmp / "out/adapter.metrics.jsonl") if "train/loss" in r]
    return config, rows, metrics(tmp / "out/adapter.rollouts.jsonl")


def recomputed_update(rows: list[dict], rollouts: list[dict], config) -> list[dict]:
    """Each update's TIS weights and loss recomputed from rollouts.jsonl (float64) and checked
    against metrics.jsonl: w = min(p_torch / p_sampler, tis_cap) with p_torch the adapter
    before the update, advantages log p_T - log p_torch, loss -sum w A / (samples x
    max_new_tokens) at ratio 1 (distill_epochs = 1). Returns what the test needs per update:
    |log w|, and what an inverted ratio or the sampler-relative advantage would have logged."""
    d, out = config.distill, []
    for row in rows:
        records = [r for r in rollouts if r["update"] == row["train/update"]]
        policy, sampler, teacher = (np.concatenate([r[k] for r in records]).astype(np.float64)
                                    for k in ("policy_logprobs", "sampler_logprobs", "teacher_logprobs"))
        log_w = policy - sampler
        weights = np.minimum(np.exp(log_w), d.tis_cap)
        denominator = len(records) * d.sampling.max_new_tokens

        def loss(student: np.ndarray) -> float:  # with advantages log p_T - log p_student
            return -(weights * np.clip(teacher - student, -d.weight_clip, d.weight_clip)).sum() / denominator

        assert row["policy/tis_weight_mean"] == pytest.approx(weights.mean(), rel=1e-6)
        assert row["policy/tis_capped_fraction"] == np.mean(np.exp(log_w) >= d.tis_cap)
        assert row["train/loss"] == pytest.approx(loss(policy), rel=1e-5)
        out.append({"abs_log_w": np.abs(log_w).mean(), "staleness": row["rollouts/staleness"],
                    "inverted_error": abs(np.minimum(np.exp(-log_w), d.tis_cap).mean() - weights.mean()),
                    "sampler_advantage_error": abs(loss(sampler) / loss(policy) - 1)})
    return out


def test_on_policy_distillation_runs_ahead_with_the_stale_sampler_corrected(tmp_path, tiny_model):
    """max_async_rollout = 1 without distill.tis_cap: the default cap applies, said in a note.
    Updates 2 and 3 sample with the adapter one update old: their TIS weights are those of
    the current adapter over the sampling one (recomputed from rollouts.jsonl), far from 1
    next to update 1's (sampled with the adapter it trains: only the llama.cpp/torch
    mismatch), and the loss takes its advantages from the current adapter. The checks tell
    an inverted ratio and the sampler-relative advantage apart (by > 10x their tolerance)."""
    config, rows, rollouts = run_distill(tmp_path, tiny_model, ahead=1)
    assert config.distill.tis_cap == 2.0
    assert any("without distill.tis_cap: using distill.tis_cap = 2" in note for note in config.notes)
    updates = recomputed_update(rows, rollouts, config)
    assert [u["staleness"] for u in updates] == [0, 1, 1]
    in_step, stale = updates[0], updates[1:]
    assert in_step["abs_log_w"] < 0.01 and all(u["abs_log_w"] > 5 * in_step["abs_log_w"] for u in stale)
    assert max(u["inverted_error"] for u in stale) > 1e-5 and max(u["sampler_advantage_error"] for u in stale) > 1e-4


def test_a_synchronous_distillation_run_has_weights_of_one_within_the_mismatch(tmp_path, tiny_model):
    """The same run with max_async_rollout = 0 and tis_cap = 2 set: every batch is sampled by
    the adapter being trained, so |log w| is only llama.cpp's difference from torch."""
    config, rows, rollouts = run_distill(tmp_path, tiny_model, ahead=0, distill_keys="tis_cap = 2.0")
    assert config.notes == ()
    updates = recomputed_update(rows, rollouts, config)
    assert all(u["staleness"] == 0 and u["abs_log_w"] < 0.01 for u in updates)
    assert all(abs(r["policy/tis_weight_mean"] - 1) < 0.01 for r in rows)


@pytest.mark.parametrize("algorithm,section,expected", [
    ("grpo", "grpo", 2.0),
    ("agent_grpo", "agent", 2.0),
    ("distill", "distill", 2.0),
    ("jsd", "distill", None),  # GKD's JSD compares whole top-k distributions: no ratio to correct
    ("explicit", "grpo", 3.0),
    ("synchronous", "grpo", None),
])
def test_an_asynchronous_run_without_tis_cap_gets_the_default_with_a_note(tmp_path, algorithm, section, expected):
    grpo = ('[run]\nalgorithm = "grpo"\n[grpo]\nprompts = "p.jsonl"\nreward_function = "r.py:f"\nupdates = 1\n'
            'prompts_per_update = 1\ngroup_size = 2\ngrpo_epochs = 1\nclip_range_low = 0.2\nclip_range_high = 0.2\n'
            'kl_coefficient = 0\n{cap}[grpo.sampling]\nmax_new_tokens = 8\n')
    distill = ('[run]\nalgorithm = "distill"\n[distill]\nteacher_path = "t.gguf"\nprompts = "p.jsonl"\nupdates = 1\n'
               'prompts_per_update = 1\n{loss}[distill.sampling]\nmax_new_tokens = 8\n')
    text = {
        "grpo": grpo.format(cap=""), "explicit": grpo.format(cap="tis_cap = 3.0\n"), "synchronous": grpo.format(cap=""),
        "agent_grpo": '[run]\nalgorithm = "agent_grpo"\n[agent]\nscenarios = "s.jsonl"\n'
                      '[agent.judge]\ncommand = ["j"]\n',
        "distill": distill.format(loss=""), "jsd": distill.format(loss='loss = "jsd"\n'),
    }[algorithm]
    ahead = 0 if algorithm == "synchronous" else 2
    training = f'[output]\npath = "out/a.gguf"\n[training]\nmax_async_rollout = {ahead}\n'
    (tmp_path / "run.toml").write_text(text + training)
    config = load_config(tmp_path / "run.toml")
    assert getattr(config, section).tis_cap == expected
    note = (f"training.max_async_rollout = 2 without {section}.tis_cap: using {section}.tis_cap = 2 to correct for the "
            f"older adapter that sampled each batch (set {section}.tis_cap to choose the cap)")
    assert config.notes == ((note,) if algorithm in ("grpo", "agent_grpo", "distill") else ())


def test_agent_grpo_runs_ahead(tmp_path, tiny_model):
    """Judge-only agentic GRPO (no sandbox): trajectories, the judge and the reward run in the
    producer thread; the run ends like a synchronous one."""
    from test_agent_grpo import JUDGED, write_run

    from retrograd.recipes import agent_grpo

    cfg = write_run(tmp_path, model=tiny_model("llama"), updates=3, scenarios_per_update=1, scenarios=(JUDGED,),
                    environment="", agent="temperature = 0.7\ntis_cap = 2.0")
    text = cfg.read_text().replace("[agent.environment]\n\n[agent.environment.tools]\ndefault = \"mini\"\n"
                                   "[agent.environment.tools.toolset.mini]\ntools = [\"write_file\", \"submit\"]\n", "")
    cfg.write_text(text.replace("threads = 2", 'threads = 1\ngeneration_threads = 1\nmax_async_rollout = 1\ncompute_dtype = "f32"'))
    result = agent_grpo.run(load_config(cfg), SilentReporter())
    rows = update_rows(tmp_path / "out/adapter.metrics.jsonl")
    assert result.updates_done == 3 and [r["rollouts/staleness"] for r in rows] == [0, 1, 1]
    spans, _ = read_timeline(tmp_path / "out/adapter.timeline.jsonl")
    assert {("sampler", "generation"), ("sampler", "judge")} <= {(s["worker"], s["phase"]) for s in spans}


@pytest.mark.parametrize("lines,needle", [
    (['{"update": 1, "phase": "generation", "start": 0, "end": 1}'], ":1: not a timeline.jsonl line"),
    (['{"update": 1, "counters": {"queued_rollouts": "x"}}'], ":1: not a timeline.jsonl line"),
    (['{"event": "start"}', "[1, 2]"], ":2: not a timeline.jsonl line"),
    (["not json"], ":1: not a timeline.jsonl line"),
    (["[" * 100_000 + "]" * 100_000], ":1: not a timeline.jsonl line"),  # json.loads: RecursionError
    (['{"update": 1e999, "counters": {}}'], ":1: not a timeline.jsonl line"),  # int(inf): OverflowError
    (['{"update": 1, "worker": "sampler", "phase": "generation", "start": 1' + "0" * 400 + ', "end": 2}'],
     ":1: not a timeline.jsonl line"),  # float of an integer beyond float range: OverflowError
])
def test_a_damaged_timeline_is_one_line(tmp_path, lines, needle):
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(lines) + "\n")
    r = subprocess.run([*RETROGRAD, "profile", "--timeline", str(path)], capture_output=True, text=True, timeout=120, check=False)
    one_line_error(r, needle)


def test_a_timeline_of_instant_spans_summarises(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text('{"event": "start"}\n{"update": 1, "worker": "trainer", "phase": "optimizer", "start": 2, "end": 2}\n')
    lines = timeline_summary(path)
    assert lines[0].startswith("Timeline (timeline.jsonl, 0 updates") and "bottleneck" in lines[-1]


def test_updates_that_train_nothing_do_not_stall_the_producer(tmp_path, tiny_model):
    """Equal rewards: every group is dead, no adapter is pushed, and the producer must still
    go on (it once waited for an adapter that never came)."""
    (tmp_path / "flat.py").write_text("def reward(prompts, completions):\n    return [0.5] * len(completions)\n")
    result = run_grpo(tmp_path, tiny_model("llama"), ahead=1, updates=4,
                      reward=f'reward_function = "{tmp_path / "flat.py"}:reward"')
    rows = update_rows(tmp_path / "out/adapter.metrics.jsonl")
    assert result.updates_done == 4 and result.steps == 0
    assert [r["rollouts/staleness"] for r in rows] == [0, 1, 1, 1]


def test_a_duty_cycle_with_async_rollouts_is_refused(tmp_path, tiny_model):
    cfg = write_config(tmp_path, tiny_model("llama"), training="max_async_rollout = 1\nmax_gpu_duty_cycle = 0.5")
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    one_line_error(r, "training.max_gpu_duty_cycle < 1 with max_async_rollout > 0")
