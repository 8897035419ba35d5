"""The distillation teacher: its tokenizer check, its scores through llama.cpp and torch
against the model's own logits, the `.topk` sidecar's round trip, and every bad input of
`retrograd distill-teacher` / an offline run stopping with one line and exit code 2."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from chats import write_chat

import retrograd
from retrograd.errors import ConfigError, DataError
from retrograd.teacher import (
    SidecarHeader,
    TeacherOptions,
    check_same_tokenizer,
    corpus_fingerprint,
    open_teacher,
    read_sidecar,
    tokenizer_fingerprint,
    write_sidecar,
)
from retrograd.training.scoring import Rollout

RETROGRAD = [sys.executable, "-m", "retrograd"]




def write_config(
    folder: Path, student: Path, teacher: Path | str, *, data: str = "train.jsonl", sidecar: str = "train.topk"
) -> Path:
    cfg = folder / "distill.toml"
    cfg.write_text(f"""
[run]
algorithm = "distill"
[model]
path = "{student}"
[output]
path = "out/adapter.gguf"
[lora]
rank = 4
alpha = 8.0
[training]
ctx = 64
micro_batch = 128
compute_dtype = "f32"
threads = 2
[distill]
mode = "topk_offline"
teacher_path = "{teacher}"
topk = 4
data = "{data}"
sidecar = "{sidecar}"
""")
    return cfg


def one_error_line(args: list, cwd: Path) -> str:
    r = subprocess.run([*RETROGRAD, *args], cwd=cwd, capture_output=True, text=True, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr)
    return lines[0]


# ----------------------------------------------------------------------------- tokenizers


def test_tokenizer_check_accepts_a_shared_vocabulary_and_refuses_another(smollm2, gemma3, tiny_model):
    tiny = tiny_model("llama")  # written with SmolLM2's vocabulary
    check_same_tokenizer(tiny, smollm2)
    assert tokenizer_fingerprint(tiny) == tokenizer_fingerprint(smollm2)
    with pytest.raises(ConfigError, match="do not share a tokenizer: 262144 vs 49152"):
        check_same_tokenizer(smollm2, gemma3)


# ----------------------------------------------------------------------------- scoring


def reference_scores(model, rollout: Rollout, k: int):
    """The model's own log-softmax at the scored positions: (logprobs [n], top-k ids, top-k logprobs)."""
    ids = list(rollout.prompt + rollout.tokens)
    logp = model.logits(ids).double().log_softmax(-1)  # [T, V]: row t predicts token t + 1
    mask = rollout.mask or (True,) * len(rollout.tokens)
    rows = [len(rollout.prompt) + i - 1 for i, m in enumerate(mask) if m]
    targets = [rollout.tokens[i] for i, m in enumerate(mask) if m]
    top_lp, top_ids = logp[rows].topk(k, dim=-1)
    return logp[rows, targets], top_ids, top_lp


@pytest.mark.parametrize("backend, tolerance", [("torch", 1e-4), ("llama.cpp", 1e-2)])
def test_teacher_scores_match_the_models_own_logits(tiny_model, backend, tolerance):
    """Shared prompts scored once (a group of three over two llama.cpp slots, so the prompt
    is decoded again for the second wave), a gap in a mask, a one-token prompt."""
    path = tiny_model("llama")
    model = retrograd.load_model(path, weights="f32")
    rng = np.random.default_rng(0)

    def tokens(n):
        return tuple(int(t) for t in rng.integers(100, 40000, n))

    prompt = tokens(9)
    rollouts = [
        Rollout(0, prompt, tokens(5)),
        Rollout(0, prompt, tokens(1)),
        Rollout(0, prompt, tokens(7), (True, False, False, True, True, False, True)),
        Rollout(1, tokens(1), tokens(6)),
        Rollout(2, tokens(4), tokens(3), (False, True, True)),
    ]
    teacher = open_teacher(
        path, backend, TeacherOptions(n_ctx=32, group=2, compute_dtype="f32", weights="f32", micro_batch=24)
    )
    try:
        scores = teacher.score(rollouts, topk=3)
    finally:
        teacher.close()
    for r, s in zip(rollouts, scores):
        logprobs, top_ids, top_lp = reference_scores(model, r, 3)
        assert s.logprobs.shape == logprobs.shape and s.topk_ids.shape == top_ids.shape
        torch.testing.assert_close(s.logprobs.double(), logprobs, atol=tolerance, rtol=0)
        torch.testing.assert_close(s.topk_logprobs.double(), top_lp, atol=tolerance, rtol=0)
        assert torch.equal(s.topk_ids, top_ids)


# ----------------------------------------------------------------------------- the sidecar


def header(rows: int, k: int = 3) -> SidecarHeader:
    return SidecarHeader(
        k=k,
        rows=rows,
        vocab_size=100,
        tokenizer_fingerprint="t" * 32,
        corpus_fingerprint="c" * 32,
        teacher="teacher.gguf",
        teacher_fingerprint="f",
        backend="torch",
    )


def test_sidecar_round_trips(tmp_path):
    rng = np.random.default_rng(1)
    chunks = [
        (rng.integers(0, 100, (n, 3)).astype(np.int32), rng.standard_normal((n, 3)).astype(np.float32))
        for n in (5, 0, 1, 11)
    ]
    path = write_sidecar(tmp_path / "c.topk", header(17), chunks)
    sidecar = read_sidecar(path)
    assert sidecar.header == header(17)
    assert np.array_equal(sidecar.ids, np.concatenate([c[0] for c in chunks]))
    assert np.array_equal(sidecar.logprobs, np.concatenate([c[1] for c in chunks]))
    assert [p.name for p in tmp_path.iterdir()] == ["c.topk"]  # no temporary file left behind


def test_damaged_sidecars_are_refused(tmp_path):
    path = write_sidecar(tmp_path / "c.topk", header(2), [(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32))])
    data = path.read_bytes()
    (tmp_path / "short.topk").write_bytes(data[:-4])
    with pytest.raises(DataError, match="bytes, expected"):
        read_sidecar(tmp_path / "short.topk")
    (tmp_path / "other.topk").write_bytes(b"GGUF" + data[4:])
    with pytest.raises(DataError, match="not a retrograd top-k sidecar"):
        read_sidecar(tmp_path / "other.topk")
    with pytest.raises(AssertionError, match="wrote 1 rows"):
        write_sidecar(tmp_path / "bad.topk", header(2), [(np.zeros((1, 3), np.int32), np.zeros((1, 3), np.float32))])
    assert not (tmp_path / "bad.topk").exists()


def test_corpus_fingerprint_sees_every_token_and_mask():
    class Seq:
        def __init__(self, ids, mask):
            self.ids, self.mask = ids, mask

    base = [Seq((1, 2, 3), (False, True, True)), Seq((4, 5), (False, True))]
    variants = [
        [Seq((1, 2, 3), (False, True, False)), base[1]],
        [Seq((1, 2, 9), (False, True, True)), base[1]],
        [Seq((1, 2), (False, True)), Seq((3, 4, 5), (False, False, True))],
        base[:1],
    ]
    prints = {corpus_fingerprint(v) for v in variants}
    assert corpus_fingerprint(base) not in prints and len(prints) == len(variants)


def test_distill_teacher_writes_the_teachers_top_k_at_each_supervised_position(tmp_path, tiny_model):
    """Through the real CLI with the torch teacher; rows checked against the teacher's own logits."""
    student, teacher = tiny_model("llama"), tiny_model("llama", seed=1)
    write_chat(tmp_path / "train.jsonl", 6, seed=0)
    cfg = write_config(tmp_path, student, teacher)
    r = subprocess.run(
        [*RETROGRAD, "distill-teacher", str(cfg), "--backend", "torch", "--k", "5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    sidecar = read_sidecar(tmp_path / "train.topk")
    assert sidecar.header.k == 5 and sidecar.header.backend == "torch" and sidecar.header.vocab_size == 49152

    from retrograd.config import load_config
    from retrograd.data import load_sft
    from retrograd.recipes.common import open_chat

    examples = load_sft(tmp_path / "train.jsonl", open_chat(load_config(cfg)), ctx=64).examples
    model = retrograd.load_model(teacher, weights="f32")
    row = 0
    for e in examples:
        _, top_ids, top_lp = reference_scores(model, Rollout(0, e.ids[:1], e.ids[1:], e.mask[1:]), 5)
        n = e.n_trained
        assert np.array_equal(sidecar.ids[row : row + n], top_ids.numpy())
        np.testing.assert_allclose(sidecar.logprobs[row : row + n], top_lp.numpy(), atol=1e-4)
        row += n
    assert row == sidecar.header.rows


# ----------------------------------------------------------------------------- bad input, through the CLI


def test_bad_teachers_and_k_stop_with_one_line(tmp_path, tiny_model, gemma3):
    student = tiny_model("llama")
    write_chat(tmp_path / "train.jsonl", 4, seed=0)
    write_config(tmp_path, student, tmp_path / "missing.gguf")
    assert "distill.teacher_path" in one_error_line(["distill-teacher", "distill.toml"], tmp_path)

    write_config(tmp_path, student, gemma3)
    assert "do not share a tokenizer" in one_error_line(["distill-teacher", "distill.toml"], tmp_path)

    write_config(tmp_path, student, tiny_model("llama", seed=1))
    assert "--k 50000 is more than the teacher's 49152-token vocabulary" in one_error_line(
        ["distill-teacher", "distill.toml", "--k", "50000"], tmp_path
    )


def test_a_sidecar_for_other_data_or_another_tokenizer_is_refused(tmp_path, tiny_model):
    from retrograd.config import load_config
    from retrograd.recipes import distill
    from retrograd.training.report import SilentReporter

    student, teacher = tiny_model("llama"), tiny_model("llama", seed=1)
    write_chat(tmp_path / "train.jsonl", 4, seed=0)
    write_chat(tmp_path / "other.jsonl", 4, seed=1)
    cfg = write_config(tmp_path, student, teacher, data="other.jsonl", sidecar="other.topk")
    distill.write_teacher_topk(load_config(cfg), SilentReporter())

    write_config(tmp_path, student, teacher, data="train.jsonl", sidecar="other.topk")
    assert "was written for other data than" in one_error_line(["train", "distill.toml"], tmp_path)

    written = read_sidecar(tmp_path / "other.topk")
    fields = {**written.header.__dict__, "tokenizer_fingerprint": "0" * 32}
    write_sidecar(
        tmp_path / "foreign.topk", SidecarHeader(**fields), [(np.asarray(written.ids), np.asarray(written.logprobs))]
    )
    cfg = write_config(tmp_path, student, teacher, data="other.jsonl", sidecar="foreign.topk")
    with pytest.raises(DataError, match="was written with another tokenizer"):
        distill.run(load_config(cfg), SilentReporter())
    assert not (tmp_path / "out").exists()
