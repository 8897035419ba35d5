"""lfm2 (Liquid LFM2: gated short convolutions between attention layers) end to end: the
layer pattern read as llama.cpp reads it, packed and shared-prefix rows, a LoRA on every
kind of projection reproduced by llama.cpp, and training. Logit parity of the base model is
tests/test_parity.py's (tiny_model("lfm2") is one of TINY_ARCHS)."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from arch_checks import assert_adapter_reproduced
from llama_ref import llama_logits
from lora_files import randomise_b

import retrograd
from retrograd.config import load_config
from retrograd.data import TokenSequence
from retrograd.errors import ConfigError, GGUFError
from retrograd.gguf.adapter import adapter_tensors, write_adapter
from retrograd.model.lora import attach_lora
from retrograd.recipes import sft
from retrograd.training.batches import Group, SharedPrefix, batch_logprobs, pack
from retrograd.training.report import SilentReporter

CONV_PROJECTIONS = ["blk.*.shortconv.in_proj.weight", "blk.*.shortconv.out_proj.weight"]
# Prompt/Answer pairs, the shape of the Rust retrograd's examples/smoke_tiny.txt
SMOKE_TEXT = "".join(f"Prompt: {a} plus {b}\nAnswer: {a + b}\n\n" for a, b in [(2, 3), (7, 1), (4, 4), (9, 6), (5, 8), (1, 1)] * 3)


def test_layer_pattern_comes_from_the_kv_head_counts(tiny_model):
    spec = retrograd.load_model(tiny_model("lfm2")).spec
    assert spec.conv_layers == (True, True, False, True)  # head_count_kv [0, 0, 2, 0]
    assert (spec.conv_kernel, spec.n_head_kv, spec.final_norm) == (3, 2, "token_embd_norm.weight")
    assert spec.qk_norm  # read from the first attention layer, not blk.0 (a conv layer)


def test_aliases_pick_attention_layers_and_conv_projections_go_by_name(tiny_model):
    model = retrograd.load_model(tiny_model("lfm2")).transformer
    assert set(attach_lora(model, ["q", "o"], 1, 2.0, seed=0).layers) == {"blk.2.attn_q.weight", "blk.2.attn_output.weight"}
    model = retrograd.load_model(tiny_model("lfm2")).transformer
    names = set(attach_lora(model, CONV_PROJECTIONS, 1, 2.0, seed=0).layers)
    assert names == {f"blk.{i}.shortconv.{p}.weight" for i in (0, 1, 3) for p in ("in_proj", "out_proj")}
    with pytest.raises(ConfigError, match="matches no trainable weight"):  # the kernel is no projection
        attach_lora(model, ["blk.*.shortconv.conv.weight"], 1, 2.0, seed=0)


def test_inspect_lists_the_mixers_and_the_conv_projections(tiny_model):
    r = subprocess.run([sys.executable, "-m", "retrograd", "inspect", "--model", str(tiny_model("lfm2"))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for expected in ("architecture   lfm2", "gated short convolution (kernel 3) on 3 of 4 layers", "q (1)", "ffn_gate (4)",
                     "blk.*.shortconv.in_proj.weight (3)", "blk.*.shortconv.out_proj.weight (3)"):
        assert expected in r.stdout, r.stdout


def test_sliding_window_attention_is_refused_in_one_line(tmp_path, tiny_model):
    """Newer lfm2 files may give their attention layers a window; we do not model it yet."""
    src = gguf.GGUFReader(tiny_model("lfm2"))
    path = tmp_path / "lfm2-swa.gguf"
    w = gguf.GGUFWriter(str(path), "lfm2")
    for key, field in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = field.types[0]
            w.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    w.add_sliding_window(16)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(int(d) for d in reversed(t.shape.tolist())))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="lfm2 with sliding-window attention layers is not supported"):
        retrograd.load_model(path)


def seq(ids, first_trained=1):
    return TokenSequence(tuple(ids), tuple(i >= first_trained for i in range(len(ids))))


def test_packed_and_shared_prefix_rows_equal_separate_rows(tiny_model):
    """The convolution sees only its own row: packed examples, a prompt packed once with its
    completions, and a prompt computed by an earlier pass (a Past) give each sequence the
    log-probs it has alone. Tolerances as in test_batches.py."""
    model = retrograd.load_model(tiny_model("lfm2")).transformer
    seqs = [seq(range(100, 131)), seq(range(400, 420), 5), seq(range(7, 60), 10)]
    separate = torch.cat([batch_logprobs(model, pack([s])) for s in seqs])
    torch.testing.assert_close(batch_logprobs(model, pack(seqs)), separate, rtol=1e-5, atol=1e-5)

    prompt = tuple(range(500, 530))
    completions = [tuple(range(600, 612)), tuple(range(700, 703)), tuple(range(800, 825))]
    members = tuple(TokenSequence(c, (True,) * len(c)) for c in completions)
    alone = torch.cat([batch_logprobs(model, pack([TokenSequence(prompt + c, (False,) * len(prompt) + (True,) * len(c))]))
                       for c in completions])
    n = alone.shape[0]
    shared = batch_logprobs(model, pack([Group(prompt, members), seq(range(40, 70))]))
    torch.testing.assert_close(shared[:n], alone, rtol=1e-5, atol=1e-5)
    earlier = batch_logprobs(model, pack([Group(prompt, members, SharedPrefix(model, prompt, "cpu"))]))
    torch.testing.assert_close(earlier, alone, rtol=1e-5, atol=1e-5)


def test_adapter_on_attention_conv_and_ffn_reproduces_our_logits_in_llama_cpp(tmp_path, tiny_model, ordinary_text):
    """llama.cpp's lfm2 graph multiplies in_proj and out_proj through build_lora_mm, so an
    adapter on them applies there as it does here."""
    base = tiny_model("lfm2")
    model = retrograd.load_model(base)
    adapter = attach_lora(model.transformer, ["q", "k", "v", "o", "ffn_up", "ffn_down", "ffn_gate", *CONV_PROJECTIONS], 4, 8.0, seed=0)
    randomise_b(adapter)
    shapes = {w.name: w.shape for w in model.transformer.frozen_weights()}
    path = write_adapter(tmp_path / "lfm2-lora.gguf", adapter_tensors(adapter), arch="lfm2", alpha=8.0, base_shapes=shapes)
    assert set(assert_adapter_reproduced(base, path, ordinary_text, changed_by=1e-2).layers) == set(adapter.layers)


def write_text_sft(folder, model, *, lora: str, training: str, extra: str = ""):
    (folder / "smoke_tiny.txt").write_text(SMOKE_TEXT)
    cfg = folder / "run.toml"
    cfg.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
[output]
path = "out/adapter.gguf"
[lora]
{lora}
[training]
threads = 2
{training}
[sft]
data = "smoke_tiny.txt"
{extra}
""")
    return cfg


def test_sft_memorises_a_text(tmp_path, tiny_model):
    """20 steps on one 40-token window: the loss falls, with the conv projections trained too."""
    targets = json.dumps(["q", "k", "v", "o", "ffn_up", "ffn_down", "ffn_gate", *CONV_PROJECTIONS])
    cfg = write_text_sft(tmp_path, tiny_model("lfm2"), lora=f'rank = 4\nalpha = 8.0\ndtype = "f32"\ntargets = {targets}',
                         training='ctx = 64\nmicro_batch = 64\ngradient_accumulation = 1\nepochs = 20\nlr = 1e-2\ncompute_dtype = "f32"')
    (tmp_path / "smoke_tiny.txt").write_text(SMOKE_TEXT[:90])
    result = sft.run(load_config(cfg), SilentReporter())
    losses = [r["train/loss"] for r in map(json.loads, (tmp_path / "out/adapter.metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert result.steps == len(losses) == 20
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


def test_retrograd_train_runs_the_rust_smoke_sft_shape(tmp_path, tiny_model):
    """examples/smoke_tiny_sft.toml of the Rust retrograd (its fixture is LFM2.5-230M): plain
    text, targets ["q"], rank 1, evaluation on the same file, checkpoints on steps and best
    eval; here on the tiny random lfm2."""
    base = tiny_model("lfm2")
    cfg = write_text_sft(
        tmp_path, base, lora='rank = 1\nalpha = 2.0\ntargets = ["q"]',
        training='ctx = 128\nmicro_batch = 16\ngradient_accumulation = 4\nepochs = 1\nlr = 1e-4',
        extra='[evaluation]\ndata = "smoke_tiny.txt"\n[checkpoint]\ndirectory = "ckpt"\nmode = "steps_and_best_eval"\nevery_steps = 2',
    )
    r = subprocess.run([sys.executable, "-m", "retrograd", "train", str(cfg)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    adapter = tmp_path / "out/adapter.gguf"
    assert adapter.is_file() and any((tmp_path / "ckpt").iterdir())
    ids = retrograd.load_model(base).tokenize(SMOKE_TEXT)[:32]
    assert torch.isfinite(llama_logits(base, ids, lora_path=adapter)).all()  # llama.cpp takes the adapter


def test_chat_on_lfm2_equals_a_fresh_run_turn_after_turn(tiny_model):
    """Inference rewinds a sequence to reuse a prompt prefix; on lfm2 llama.cpp refuses the
    rewind, and the prompt is computed again from the start instead."""
    from retrograd.serving.inference import BASE, Inference, Settings

    path = tiny_model("lfm2")

    def reply(inference, history):
        generation = inference.generate(BASE, inference.chat_prompt(history), Settings(max_tokens=6))
        generation.run()
        return generation.text, generation.completion_tokens

    system = "You answer questions about geography. " * 8  # the prompt spans more than one 64-token chunk
    history = [{"role": "system", "content": system}, {"role": "user", "content": "Hello there"}]
    with Inference(path, n_ctx=512, n_threads=2, chat_template="chatml") as continued:
        for turn in range(3):
            answer = reply(continued, history)
            with Inference(path, n_ctx=512, n_threads=2, chat_template="chatml") as fresh:
                assert answer == reply(fresh, history), turn
            history += [{"role": "assistant", "content": answer[0]}, {"role": "user", "content": "And then?"}]
