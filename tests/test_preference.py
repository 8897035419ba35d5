"""Preference training: each loss against TRL's formulas restated here, the data shapes
users have, DPO on the bundled SmolLM2 checked in llama.cpp with the exported adapter, every
loss end to end, exact resume, and bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llama_ref import llama_logits

from retrograd.config import load_config
from retrograd.data.preference import Labelled, Pair, load_preference
from retrograd.evaluation import bench
from retrograd.objectives import preference as losses
from retrograd.recipes import preference
from retrograd.recipes.common import open_chat
from retrograd.reports.run_report import RunReport, run_files
from retrograd.runtime.bundled import default_model_path
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
WORDS = ("hello there|good morning|see you soon|thank you|nice work|well done|what a day|let us go|keep going|all set|"
         "on my way|be right back|sounds good|no problem|take care|happy new year|have fun|stay safe|good luck|try again").split("|")


def shout(word: str) -> dict:
    """Chosen: the words in capitals; rejected: as given."""
    return {"prompt": [{"role": "user", "content": f"Shout: {word}"}],
            "chosen": [{"role": "assistant", "content": word.upper()}],
            "rejected": [{"role": "assistant", "content": word}]}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_config(tmp: Path, *, loss: str = "dpo", epochs: int = 3, extra: str = "", train=None, held_out=None, lr: float = 1e-3) -> Path:
    write_jsonl(tmp / "train.jsonl", train if train is not None else [shout(w) for w in WORDS[:16]])
    write_jsonl(tmp / "eval.jsonl", held_out if held_out is not None else [shout(w) for w in WORDS[16:]])
    cfg = tmp / "run.toml"
    cfg.write_text(f"""
[run]
algorithm = "preference"
[output]
path = "out/adapter.gguf"
[lora]
rank = 8
alpha = 16.0
dtype = "f32"
[training]
ctx = 128
micro_batch = 256
compute_dtype = "f32"
epochs = {epochs}
lr = {lr}
[preference]
data = "train.jsonl"
loss = "{loss}"
{extra}
[evaluation]
data = "eval.jsonl"
""")
    return cfg


# ----------------------------------------------------------------------------- the losses


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


CASES = [  # (chosen sum, rejected sum, ref chosen, ref rejected, chosen tokens, rejected tokens)
    (-12.5, -15.0, -13.0, -14.0, 5, 7),
    (-30.0, -8.0, -29.0, -9.5, 12, 3),
    (-2.25, -2.5, -2.25, -2.5, 4, 4),
    (-0.3, -40.0, -1.0, -20.0, 2, 20),
]


def trl_dpo(c, r, rc, rr, beta, eps):
    """TRL's sigmoid loss; with eps > 0 the conservative DPO of TRL before 1.x (1.16 ignores eps)."""
    m = beta * ((c - rc) - (r - rr))
    return -log_sigmoid(m) * (1 - eps) - log_sigmoid(-m) * eps


def trl_ipo(c, r, rc, rr, nc, nr, beta):
    logits = (c / nc - r / nr) - (rc / nc - rr / nr)
    return (logits - 1 / (2 * beta)) ** 2


def trl_simpo(c, r, nc, nr, beta, gamma):
    return -log_sigmoid(beta * ((c / nc - r / nr) - gamma))


def trl_orpo(c, r, nc, nr, beta):
    lc, lr_ = c / nc, r / nr
    log_odds = (lc - lr_) - (math.log1p(-math.exp(lc)) - math.log1p(-math.exp(lr_)))
    return -lc - beta * log_sigmoid(log_odds)


def test_paired_losses_equal_trls_formulas():
    t = [torch.tensor(col, dtype=torch.float64) for col in zip(*CASES)]
    p = losses.PairLogps(t[0], t[1], t[4], t[5], t[2], t[3])
    for beta, eps in ((0.1, 0.0), (0.5, 0.2)):
        ours, chosen, rejected = losses.dpo(p, beta, eps)
        for k, (c, r, rc, rr, _, _) in enumerate(CASES):
            assert abs(ours[k].item() - trl_dpo(c, r, rc, rr, beta, eps)) <= 1e-6
            assert abs(chosen[k].item() - beta * (c - rc)) <= 1e-6 and abs(rejected[k].item() - beta * (r - rr)) <= 1e-6
    ours, chosen, _ = losses.ipo(p, 0.1)
    assert all(abs(ours[k].item() - trl_ipo(c, r, rc, rr, nc, nr, 0.1)) <= 1e-6 for k, (c, r, rc, rr, nc, nr) in enumerate(CASES))
    assert all(abs(chosen[k].item() - 0.1 * (c - rc)) <= 1e-6 for k, (c, _, rc, *_) in enumerate(CASES))  # TRL logs beta (S - R)
    ours, chosen, _ = losses.simpo(p, 2.0, 0.5)
    for k, (c, r, _, _, nc, nr) in enumerate(CASES):
        assert abs(ours[k].item() - trl_simpo(c, r, nc, nr, 2.0, 0.5)) <= 1e-6
        assert abs(chosen[k].item() - 2.0 * c / nc) <= 1e-6
    ours, _, _ = losses.orpo(p, 0.1)
    assert all(abs(ours[k].item() - trl_orpo(c, r, nc, nr, 0.1)) <= 1e-6 for k, (c, r, _, _, nc, nr) in enumerate(CASES))


def test_kto_equals_trls_formula():
    logps = torch.tensor([-10.0, -4.0, -7.5, -20.0], dtype=torch.float64)
    ref = torch.tensor([-11.0, -3.0, -7.5, -18.0], dtype=torch.float64)
    desirable = torch.tensor([True, True, False, False])
    kl_policy, kl_ref = torch.tensor([-25.0, -30.0]), torch.tensor([-26.5, -30.1])
    z0 = losses.kto_reference_point(kl_policy, kl_ref)
    assert abs(z0.item() - max(0.0, ((-25.0 + 26.5) + (-30.0 + 30.1)) / 2)) <= 1e-6
    ours, rewards = losses.kto(logps, ref, desirable, z0, 0.1, 1.5, 0.7)
    for k in range(4):
        ratio = logps[k].item() - ref[k].item()
        sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        expected = 1.5 * (1 - sig(0.1 * (ratio - z0.item()))) if desirable[k] else 0.7 * (1 - sig(0.1 * (z0.item() - ratio)))
        assert abs(ours[k].item() - expected) <= 1e-6 and abs(rewards[k].item() - 0.1 * ratio) <= 1e-6
    assert losses.kto_reference_point(torch.tensor([-5.0]), torch.tensor([-1.0])).item() == 0.0  # clamped at 0


def test_losses_are_differentiable_in_the_policy_only():
    c = torch.tensor([-3.0], requires_grad=True)
    r = torch.tensor([-4.0], requires_grad=True)
    n = torch.tensor([3.0])
    for name in ("dpo", "ipo", "simpo", "orpo"):
        p = losses.PairLogps(c, r, n, n, torch.tensor([-3.5]), torch.tensor([-3.5]))
        loss, chosen, rejected = losses.pair_loss(p, name, beta=0.1)
        (g_c, g_r) = torch.autograd.grad(loss.sum(), (c, r))
        assert g_c.item() < 0 < g_r.item(), name  # lowering the loss raises chosen, lowers rejected
        assert not chosen.requires_grad and not rejected.requires_grad


# ----------------------------------------------------------------------------- the data


def chat_of(tmp_path) -> object:
    return open_chat(load_config(write_config(tmp_path)))


def test_pairs_share_their_prompt_and_train_the_answer_only(tmp_path):
    chat = chat_of(tmp_path)
    data = load_preference(tmp_path / "train.jsonl", chat, ctx=128, unpaired=False)
    assert "pairs with an explicit prompt, conversational, 16 records" in data.description
    pair = data.items[0]
    assert isinstance(pair, Pair) and pair.source.endswith("train.jsonl:1")
    text = chat.tokenizer.decode(list(pair.prompt))
    assert text.endswith("Shout: hello there<|im_end|>\n<|im_start|>assistant\n"), text
    assert chat.tokenizer.decode(list(pair.chosen.ids)).startswith("HELLO THERE<|im_end|>")
    assert chat.tokenizer.decode(list(pair.rejected.ids)).startswith("hello there<|im_end|>")
    end = next(i for i, t in enumerate(pair.chosen.ids) if t in chat.tokenizer.eog_ids)
    assert all(pair.chosen.mask[: end + 1])  # the answer and its end of turn are trained
    assert not pair.chosen.mask[-1]  # the newline after <|im_end|> is not


def test_implicit_prompt_and_plain_text_shapes(tmp_path):
    chat = chat_of(tmp_path)
    explicit = load_preference(tmp_path / "train.jsonl", chat, ctx=128, unpaired=False).items[0]
    implicit = write_jsonl(tmp_path / "implicit.jsonl", [
        {"chosen": shout("hello there")["prompt"] + shout("hello there")["chosen"],
         "rejected": shout("hello there")["prompt"] + shout("hello there")["rejected"]}])
    data = load_preference(implicit, chat, ctx=128, unpaired=False)
    assert "implicit prompt" in data.description and data.items[0].prompt == explicit.prompt
    assert data.items[0].chosen == explicit.chosen and data.items[0].rejected == explicit.rejected
    word = write_jsonl(tmp_path / "word.jsonl", [{"prompt": "The sky is bl", "chosen": "ue.", "rejected": "ack."}])
    pair = load_preference(word, chat, ctx=128, unpaired=False).items[0]
    assert chat.tokenizer.decode(list(pair.chosen.ids)).startswith("blue") or pair.chosen.n_trained >= 2  # the word, not EOS alone
    assert pair.chosen.mask[0]
    text = write_jsonl(tmp_path / "text.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."}])
    pair = load_preference(text, chat, ctx=128, unpaired=False).items[0]
    assert chat.tokenizer.decode(list(pair.prompt)).endswith("The sky is")  # split before the space, as TRL
    assert chat.tokenizer.decode(list(pair.chosen.ids)).startswith(" blue.")
    assert pair.chosen.ids[-1] == chat.tokenizer.eos_id and pair.chosen.mask[-1]  # plain text learns to stop


def test_csv_and_parquet_read_as_jsonl(tmp_path):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = chat_of(tmp_path)
    expected = load_preference(tmp_path / "train.jsonl", chat, ctx=128, unpaired=False).items[:3]
    rows = [shout(w) for w in WORDS[:3]]
    with open(tmp_path / "pairs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "chosen", "rejected"])
        writer.writerows([[json.dumps(r[k]) for k in ("prompt", "chosen", "rejected")] for r in rows])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    for name in ("pairs.csv", "pairs.parquet"):
        got = load_preference(tmp_path / name, chat, ctx=128, unpaired=False).items
        assert [(p.prompt, p.chosen, p.rejected) for p in got] == [(p.prompt, p.chosen, p.rejected) for p in expected]


def test_kto_records(tmp_path):
    chat = chat_of(tmp_path)
    rows = [{"prompt": s["prompt"], "completion": s["chosen"], "label": True} for s in map(shout, WORDS[:2])]
    rows.append({"prompt": "Say hi", "completion": " hi", "label": False})
    with pytest.raises(Exception, match="one file holds one shape"):  # text after conversations
        load_preference(write_jsonl(tmp_path / "mixed.jsonl", rows), chat, ctx=128, unpaired=True)
    data = load_preference(write_jsonl(tmp_path / "kto.jsonl", rows[:2] + [dict(rows[0], label=False)]), chat, ctx=128, unpaired=True)
    assert all(isinstance(x, Labelled) for x in data.items) and [x.desirable for x in data.items] == [True, True, False]
    assert "unpaired answers with a label (KTO)" in data.description


@pytest.mark.parametrize("record,needle", [
    ({**shout("a b"), "rejected": shout("a b")["chosen"]}, "the chosen and rejected answers are the same"),
    ({**shout("a b"), "chosen": [{"role": "assistant", "content": ""}]}, 'message 2: empty content'),
    ({**shout("a b"), "chosen": [{"role": "user", "content": "x"}]}, '"chosen" has no assistant turn to train'),
    (shout("word " * 80), "more than ctx = 128 tokens"),
    ({"prompt": "x", "chosen": "y"}, "missing rejected"),
    ({"prompt": "x", "chosen": [{"role": "assistant", "content": "y"}], "rejected": "z"}, "both be text or both lists"),
])
def test_bad_records_name_file_and_line(tmp_path, record, needle):
    cfg = write_config(tmp_path, train=[shout("fine"), record])
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "train.jsonl:2" in lines[0] and needle in lines[0], lines[0]
    assert not (tmp_path / "out/adapter.gguf").exists()


def test_a_key_the_loss_does_not_read_is_an_error(tmp_path):
    cfg = write_config(tmp_path, loss="orpo", extra="label_smoothing = 0.1\nreference = \"base\"")
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "preference.label_smoothing is not read by loss = 'orpo' (it applies to dpo)" in r.stderr
    assert "preference.reference is not read by loss = 'orpo' (it applies to dpo, ipo, kto)" in r.stderr


@pytest.mark.parametrize("loss,extra,needle", [
    ("simpo", "", "[reference] applies to the losses with a reference (dpo, ipo, kto), not 'simpo'"),
    ("dpo", 'reference = "base"', "preference.reference: leave it out when [reference] names the reference model"),
])
def test_reference_model_config_errors(tmp_path, smollm2_f32, loss, extra, needle):
    cfg = write_config(tmp_path, loss=loss, extra=extra)
    cfg.write_text(cfg.read_text() + f'[reference]\nmodel = "{smollm2_f32}"\n')
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_reference_model_with_another_tokenizer_is_refused(tmp_path, gemma3):
    cfg = write_config(tmp_path)
    cfg.write_text(cfg.read_text() + f'[reference]\nmodel = "{gemma3}"\n')
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"reference.model {gemma3.name} and the base SmolLM2-135M-Instruct.Q4_1.gguf do not share a tokenizer" in r.stderr
    assert "loading model" not in r.stdout  # refused before the base loads


@pytest.mark.slow  # ~15 s
def test_a_reference_model_is_the_reference(tmp_path, tiny_model):
    """[reference] model = a tiny random llama with SmolLM2's tokenizer: step 1's loss is no
    longer log 2 (policy and reference differ), the log-probs are that model's, and it is loaded
    once, only to score."""
    train = [shout(w) for w in WORDS[:4]]
    cfg_base = load_config(write_config(tmp_path, epochs=1, train=train))
    other = tmp_path / "other"
    other.mkdir()
    cfg = write_config(other, epochs=1, train=train)
    reference_model = tiny_model("llama")
    cfg.write_text(cfg.read_text() + f'[reference]\nmodel = "{reference_model}"\n')
    messages = []

    class Collect(SilentReporter):
        def message(self, text):
            messages.append(text)

    with_model = preference.run(load_config(cfg), Collect())
    assert any(f"reference log-probs of 8 record(s) ([reference] model {reference_model.name})" in m for m in messages), messages
    assert sum(f"reference model {reference_model.name} loaded" in m for m in messages) == 1
    base = preference.run(cfg_base, SilentReporter())
    assert base.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert abs(with_model.losses[0] - math.log(2)) > 1e-2


def test_kto_needs_two_records_per_step(tmp_path):
    rows = [{"prompt": s["prompt"], "completion": s["chosen"], "label": True} for s in map(shout, WORDS[:4])]
    cfg = write_config(tmp_path, loss="kto", train=rows, held_out=rows, extra="pairs_per_step = 1")
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and "loss = 'kto' needs at least 2 records per step" in r.stderr, r.stderr
    assert "a step holds 1" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_pairs_per_step_and_accumulation_exclude_each_other(tmp_path):
    cfg = write_config(tmp_path, extra="pairs_per_step = 2")
    cfg.write_text(cfg.read_text().replace("epochs = 3", "epochs = 3\ngradient_accumulation = 2"))
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and "preference.pairs_per_step and training.gradient_accumulation both size a step" in r.stderr


def test_kto_refuses_pairs(tmp_path):
    cfg = write_config(tmp_path, loss="kto")
    r = subprocess.run([*RETROGRAD, "train", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 2 and "train.jsonl:1: loss kto reads unpaired records" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- training


def logp_margin(model: Path, pair: Pair, adapter: Path | None) -> float:
    """log p(chosen) - log p(rejected) after the prompt, from llama.cpp's own logits."""
    def answer_logp(answer) -> float:
        ids = list(pair.prompt) + list(answer.ids)
        logits = llama_logits(model, ids, lora_path=adapter)
        logp = logits.double().log_softmax(-1)
        start = len(pair.prompt)
        return sum(logp[start + i - 1, ids[start + i]].item() for i, trained in enumerate(answer.mask) if trained)
    return answer_logp(pair.chosen) - answer_logp(pair.rejected)


def test_dpo_on_smollm2_learns_a_preference_llama_cpp_confirms(tmp_path):
    """16 pairs 'Shout: ...' with the answer in capitals preferred; 4 held-out pairs. The held-out
    accuracy reaches 1, and llama.cpp with the exported adapter prefers the chosen answers by a
    wider log-prob margin than the base does on every held-out pair."""
    cfg = load_config(write_config(tmp_path))
    result = preference.run(cfg, SilentReporter())
    assert result.eval_metrics["eval/rewards/accuracies"] >= 0.9
    assert result.losses[-1] < 0.1 < result.losses[0]
    rows = [json.loads(line) for line in (tmp_path / "out/adapter.metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "rewards/margins" in r)
    for name in ("train/loss", "train/lr", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert name in step, name
    page = RunReport(run_files(cfg)).write().read_text()
    assert "Preference accuracy" in page and "eval/rewards/accuracies" in page
    measured = bench.run(cfg, SilentReporter())  # base vs adapter on the held-out pairs, in torch
    accuracy = next(row for row in measured.rows() if row.metric.startswith("accuracy"))
    assert accuracy.adapter >= 0.9 and accuracy.adapter > accuracy.base and measured.verdict().label == "improved"
    held_out = load_preference(tmp_path / "eval.jsonl", open_chat(cfg), ctx=128, unpaired=False).items
    model = default_model_path()
    for pair in held_out:
        before, after = logp_margin(model, pair, None), logp_margin(model, pair, result.output)
        print(f"{pair.source}: llama.cpp margin base {before:.2f} -> adapter {after:.2f}")
        assert after > before + 1.0 and after > 0


@pytest.mark.slow  # ~26 s: the default suite trains DPO on SmolLM2 above
@pytest.mark.parametrize("loss,extra", [("ipo", ""), ("simpo", ""), ("orpo", ""), ("dpo", 'reference = "base"\nlabel_smoothing = 0.1')])
def test_every_paired_loss_trains(tmp_path, loss, extra):
    cfg = load_config(write_config(tmp_path, loss=loss, epochs=2, extra=extra, train=[shout(w) for w in WORDS[:8]]))
    result = preference.run(cfg, SilentReporter())
    assert result.output.is_file() and all(math.isfinite(x) for x in result.losses)
    assert result.eval_metrics["eval/rewards/margins"] > 0


@pytest.mark.slow  # ~22 s
def test_kto_trains(tmp_path):
    rows = [{"prompt": s["prompt"], "completion": s["chosen"], "label": True} for s in map(shout, WORDS[:6])]
    rows += [{"prompt": s["prompt"], "completion": s["rejected"], "label": False} for s in map(shout, WORDS[6:12])]
    held = [{"prompt": s["prompt"], "completion": s[k], "label": k == "chosen"} for s in map(shout, WORDS[16:]) for k in ("chosen", "rejected")]
    cfg = load_config(write_config(tmp_path, loss="kto", epochs=3, train=rows, held_out=held, extra="desirable_weight = 1.0"))
    result = preference.run(cfg, SilentReporter())
    assert result.eval_metrics["eval/rewards/margins"] > 0 and result.eval_metrics["eval/rewards/accuracies"] > 0.5
    assert result.losses[-1] < result.losses[0]


def test_the_drop_warning_fires_once_when_both_answers_fall():
    messages = []

    class Collect(SilentReporter):
        def message(self, text):
            messages.append(text)

    progress = {"warned_drop": False}
    preference.watch_chosen_logps(progress, 2.5, -0.5, 2.0, Collect())  # rejected rose: the margin works as meant
    preference.watch_chosen_logps(progress, 1.5, 3.0, 2.0, Collect())  # chosen within the limit
    assert messages == []
    preference.watch_chosen_logps(progress, 2.5, 4.0, 2.0, Collect())
    preference.watch_chosen_logps(progress, 3.5, 5.0, 2.0, Collect())
    assert len(messages) == 1 and "2.50 nats below where it started" in messages[0] and progress["warned_drop"]


@pytest.mark.slow  # ~22 s
def test_resume_repeats_the_run(tmp_path):
    """Killed after step 4 of 6 (the checkpoint is what a kill leaves), resumed: the same losses,
    the reference log-probs read from the checkpoint, not recomputed."""
    ckpt = '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 2'
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for d in (straight, resumed):
        d.mkdir()
        write_config(d, epochs=2, train=[shout(w) for w in WORDS[:12]], extra="pairs_per_step = 4").write_text(
            (d / "run.toml").read_text().replace("[training]", "[training]\nthreads_follow_load = false") + ckpt)
    whole = preference.run(load_config(straight / "run.toml"), SilentReporter())
    assert len(whole.losses) == 6
    first = preference.run(load_config(resumed / "run.toml"), SilentReporter())
    state = next((resumed / "ckpt").glob("step-*4.state"))
    messages = []

    class Collect(SilentReporter):
        def message(self, text):
            messages.append(text)

    again = preference.run(load_config(resumed / "run.toml"), Collect(), resume=state)
    assert again.losses == first.losses[4:] == whole.losses[4:]
    assert any("resumed from" in m for m in messages) and not any("reference log-probs" in m for m in messages)
