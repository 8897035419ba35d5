"""`retrograd inspect` / `preflight` through the real command: reports, and one-line
errors with exit code 2 for every kind of bad model file, answered (as train's bad
arguments and config are) before torch is imported."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from imports import run_noting_import

from retrograd.gguf.spec import SUPPORTED_ARCHS

RETROGRAD = [sys.executable, "-m", "retrograd"]


def run(*args, timeout=300):
    return subprocess.run([*RETROGRAD, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert str(needle) in lines[0], lines[0]


def test_inspect_reports_the_bundled_model():
    r = run("inspect")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for expected in ("architecture   llama", "layers         30", "vocabulary     49152", "Q4_1", "chat template  present",
                     "q (30)", "ffn_gate (30)", "device         cpu"):
        assert expected in out, out


def test_inspect_gemma3(gemma3):
    r = run("inspect", "--model", gemma3)
    assert r.returncode == 0, r.stderr
    assert "gemma3" in r.stdout and "sliding window 512 on 15 of 18 layers" in r.stdout and "absent" in r.stdout


@pytest.fixture
def bad_files(tmp_path, smollm2, tiny_model):
    good = smollm2.read_bytes()
    files = {}
    files["missing"] = tmp_path / "nope.gguf"
    files["directory"] = tmp_path
    (tmp_path / "empty.gguf").write_bytes(b"")
    files["empty"] = tmp_path / "empty.gguf"
    (tmp_path / "text.gguf").write_text("hello, I am not a model\n")
    files["not gguf"] = tmp_path / "text.gguf"
    (tmp_path / "header-cut.gguf").write_bytes(good[:5000])
    files["truncated header"] = tmp_path / "header-cut.gguf"
    (tmp_path / "data-cut.gguf").write_bytes(good[: len(good) // 2])
    files["truncated data"] = tmp_path / "data-cut.gguf"
    corrupt = bytearray(good[:4096])
    corrupt[4:8] = (77).to_bytes(4, "little")  # version 77
    (tmp_path / "version.gguf").write_bytes(bytes(corrupt) + good[4096:])
    files["bad version"] = tmp_path / "version.gguf"
    garbage = bytearray(good)
    garbage[24:32] = (2**40).to_bytes(8, "little")  # the first key's length: absurd
    (tmp_path / "garbage.gguf").write_bytes(bytes(garbage))
    files["corrupted"] = tmp_path / "garbage.gguf"
    w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    files["unsupported architecture"] = tmp_path / "arch.gguf"
    return files


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "no such file"),
        ("directory", "is a directory"),
        ("empty", "empty file"),
        ("not gguf", "not a GGUF file"),
        ("truncated header", "truncated"),
        ("truncated data", "truncated"),
        ("bad version", "version 77"),
        ("corrupted", "truncated"),
        ("unsupported architecture", f"'mamba' is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"),
    ],
)
def test_bad_model_files_give_one_line_errors(bad_files, case, needle):
    path = bad_files[case]
    for command in ("inspect", "preflight"):
        assert_one_line_error(run(command, "--model", path, timeout=60), path, needle)


@pytest.mark.parametrize("args,needle", [
    (("inspect", "--model", "{tmp}/missing.gguf"), "missing.gguf"),
    (("inspect", "--model", "{tmp}/not.gguf"), "not a GGUF file"),
    (("preflight", "--model", "{tmp}"), "is a directory"),
    (("preflight", "{tmp}/missing.toml"), "missing.toml"),
    (("train", "{tmp}/missing.toml"), "missing.toml"),
    (("train", "{tmp}/bad.toml"), "lora.rnak: unknown key"),
    (("train", "{tmp}/bad.toml", "--resume", "ckpt"), "--resume takes no value"),
    (("profile", "--timeline", "{tmp}/not.gguf"), "not.gguf:1: not a timeline.jsonl line"),
    (("collect", "{tmp}/sft.toml", "--out", "{tmp}/out.jsonl"), "run.algorithm = 'sft'; collect rolls out agent_grpo configs"),
], ids=["inspect missing", "inspect not gguf", "preflight directory", "preflight missing config", "train missing config",
        "train bad key", "train resume with a value", "profile damaged timeline", "collect of an sft config"])
def test_bad_input_stops_before_torch_is_imported(tmp_path, args, needle):
    """Importing torch takes about 2 s: a mistyped path or key is answered without it."""
    (tmp_path / "not.gguf").write_text("text")
    (tmp_path / "bad.toml").write_text('[run]\nalgorithm = "sft"\n[lora]\nrnak = 4\n')
    (tmp_path / "sft.toml").write_text('[run]\nalgorithm = "sft"\n[output]\npath = "out/a.gguf"\n[sft]\ndata = "d.jsonl"\n')
    r = run_noting_import("torch", *(a.format(tmp=tmp_path) for a in args))
    assert r.stdout.strip() == "exit 2, torch imported: False", (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def _tiny_with_type(tmp_path, tiny_model, qtype):
    """A copy of the tiny llama model whose attn_q of block 0 is stored as `qtype`."""
    src = gguf.GGUFReader(tiny_model("llama"))
    dst = tmp_path / f"tiny-{qtype.name}.gguf"
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = field.types[0]
        w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        if t.name == "blk.0.attn_q.weight":
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.random.default_rng(0).integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            if qtype == QT.IQ4_NL:  # a finite f16 scale leads each block
                blocks = raw.reshape(-1, size)
                blocks[:, :2] = np.full((blocks.shape[0], 1), 0.01, np.float16).view(np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape(shape))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def test_type_without_any_dequantizer_is_refused(tmp_path, tiny_model):
    path = _tiny_with_type(tmp_path, tiny_model, QT.Q8_K)
    assert_one_line_error(run("preflight", "--model", path), path, "blk.0.attn_q.weight", "Q8_K")


def test_type_without_torch_kernel_is_dequantized_once_with_a_note(tmp_path, tiny_model):
    path = _tiny_with_type(tmp_path, tiny_model, QT.IQ4_NL)
    r = run("preflight", "--model", path)
    assert r.returncode == 0, r.stderr
    assert "IQ4_NL have no torch kernel: dequantized once at load" in r.stdout
    assert "status: ok" in r.stdout


def test_unknown_target_names_the_closest_one():
    assert_one_line_error(run("preflight", "--targets", "q,ffn_upp"), "lora.targets", "'ffn_upp'", "did you mean 'ffn_up'")


def test_gpu_without_gpu_is_an_error():
    assert_one_line_error(run("inspect", "--device", "gpu"), "no CUDA GPU")


def test_preflight_reports_probe_and_estimates():
    r = run("preflight", "--ctx", "256", "--micro-batch", "64", "--strict")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "off device     none" in out and "status: ok" in out
    for label in ("base weights", "lora", "optimizer state", "activations", "total"):
        assert f"  {label}" in out
    assert "LoRA rank 2 on 210 weights" in out
