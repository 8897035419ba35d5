"""`retrograd merge` and `[output] kind = "model"`: the merged GGUF must run in stock
llama.cpp as the base with the adapter applied does, keep the base's metadata and untouched
tensors as they were, and bad input must stop on one line before anything is written."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from chats import write_chat
from gguf import GGMLQuantizationType as QT
from llama_ref import agreement, llama_logits

from retrograd.config import load_config, parse_config
from retrograd.errors import ConfigError
from retrograd.gguf.adapter import LoRAWeights, read_adapter, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.gguf.merge import merge, plan_merge, write_merged
from retrograd.model.lora import resolve_targets
from retrograd.model.tokenizer import Tokenizer
from retrograd.recipes import sft
from retrograd.training.report import SilentReporter

RETROGRAD = [sys.executable, "-m", "retrograd"]
PROMPT = "The capital of France is Paris, and the capital of Germany is"


def random_adapter(model: Path, dst: Path, *, rank: int = 8, b_std: float = 0.05, arch: str | None = None, targets=("auto",)) -> Path:
    """A LoRA on `targets` (all seven families by default) with non-zero B, as after some training."""
    f = GGUFFile(model)
    shapes = {n: t.shape for n, t in f.tensors.items() if len(t.shape) == 2}
    rng = np.random.default_rng(0)
    tensors = {
        n: LoRAWeights(
            (rng.standard_normal((rank, shapes[n][1])) / np.sqrt(shapes[n][1])).astype(np.float32),
            (rng.standard_normal((shapes[n][0], rank)) * b_std).astype(np.float32),
        )
        for n in resolve_targets(list(targets), list(shapes))
    }
    return write_adapter(dst, tensors, arch=arch or f.get_str("general.architecture"), alpha=16.0, base_shapes=shapes)


def ids_of(model: Path) -> list[int]:
    return Tokenizer(model).encode(PROMPT)


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    """(folder, F32 tiny llama, its adapter, llama.cpp's logits of base+adapter)."""
    folder = tmp_path_factory.mktemp("merge")
    model = tiny_model("llama")
    adapter = random_adapter(model, folder / "adapter.gguf")
    return folder, model, adapter, llama_logits(model, ids_of(model), lora_path=adapter)


def test_same_on_an_f32_model_equals_base_plus_adapter_in_llama_cpp(tiny):
    folder, model, adapter, reference = tiny
    merged = merge(model, adapter, folder / "same.gguf", "same").out
    ours = llama_logits(merged, ids_of(model))
    base_gap = (llama_logits(model, ids_of(model)) - reference).abs().max().item()
    assert base_gap > 0.1  # the adapter changes the logits: a merge that dropped it would fail below
    assert (ours - reference).abs().max().item() < 1e-4  # float32 summation order only (measured 5e-6)


def test_f16_merge_is_within_the_f16_rounding_of_the_weights(tiny):
    """The merged f16 model differs from base+adapter by what storing the weights in f16
    costs; that noise floor is measured with the same merge of an adapter whose B is 0."""
    folder, model, adapter, reference = tiny
    ids = ids_of(model)
    merged = merge(model, adapter, folder / "f16.gguf", "f16").out
    loaded = read_adapter(adapter)
    zero = {n: LoRAWeights(w.a, np.zeros_like(w.b)) for n, w in loaded.tensors.items()}
    shapes = {n: t.shape for n, t in GGUFFile(model).tensors.items()}
    zero_adapter = write_adapter(folder / "zero.gguf", zero, arch="llama", alpha=loaded.alpha, base_shapes=shapes)
    floor, _ = agreement(llama_logits(model, ids), llama_logits(merge(model, zero_adapter, folder / "f16-zero.gguf").out, ids))
    kl, top1 = agreement(reference, llama_logits(merged, ids))
    kl_base, _ = agreement(reference, llama_logits(model, ids))
    assert 0 < floor and kl < 10 * floor and kl < kl_base / 100, (kl, floor, kl_base)
    assert top1 == 1.0


def test_metadata_kept_untouched_tensors_copied_byte_for_byte(tiny):
    folder, model, adapter, _ = tiny
    merged = GGUFFile(merge(model, adapter, folder / "meta.gguf", "bf16").out)
    base, adapted = GGUFFile(model), read_adapter(adapter).tensors
    assert merged.keys() == base.keys()
    assert all(merged.get(k) == base.get(k) for k in base.keys())  # tokenizer and chat template included
    assert list(merged.tensors) == list(base.tensors)
    for name, t in base.tensors.items():
        m = merged.tensors[name]
        if name in adapted:
            assert m.qtype == QT.BF16 and m.shape == t.shape
        else:
            assert m.qtype == t.qtype and m.data.tobytes() == t.data.tobytes()


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1])
def test_same_on_a_legacy_quant_keeps_types_and_size_and_loads(tiny, tiny_model, qtype):
    folder = tiny[0]
    model = tiny_model("llama", qtype=qtype)
    adapter = random_adapter(model, folder / f"adapter-{qtype.name}.gguf")
    merged = merge(model, adapter, folder / f"same-{qtype.name}.gguf", "same").out
    assert merged.stat().st_size == model.stat().st_size
    assert {n: t.qtype for n, t in GGUFFile(merged).tensors.items()} == {n: t.qtype for n, t in GGUFFile(model).tensors.items()}
    ids = ids_of(model)
    reference, ours = llama_logits(model, ids, lora_path=adapter), llama_logits(merged, ids)
    kl, _ = agreement(reference, ours)
    kl_base, _ = agreement(reference, llama_logits(model, ids))
    assert kl < kl_base, (kl, kl_base)  # with a LoRA this large (b_std 0.05) most of its effect survives


@pytest.mark.slow
def test_same_on_gemma3_q4_k_m_is_the_same_size_and_runs(gemma3, tmp_path):
    """K-quants go through llama.cpp's own quantizer."""
    adapter = random_adapter(gemma3, tmp_path / "adapter.gguf")
    merged = merge(gemma3, adapter, tmp_path / "same.gguf", "same").out
    assert merged.stat().st_size == gemma3.stat().st_size
    types = {t.qtype for t in GGUFFile(merged).tensors.values()}
    assert QT.Q4_K in types and types == {t.qtype for t in GGUFFile(gemma3).tensors.values()}
    ids = ids_of(gemma3)
    reference = llama_logits(gemma3, ids, lora_path=adapter)
    kl, _ = agreement(reference, llama_logits(merged, ids))
    kl_base, _ = agreement(reference, llama_logits(gemma3, ids))
    assert kl < kl_base / 4, (kl, kl_base)  # a large LoRA's effect survives 4-bit re-quantization


def test_rows_that_are_not_whole_q8_0_blocks_are_written_f16_with_a_note(tmp_path):
    model = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    rng = np.random.default_rng(0)
    weights = {"blk.0.attn_q.weight": rng.standard_normal((8, 48)), "blk.0.attn_k.weight": rng.standard_normal((8, 64))}
    for name, values in weights.items():
        w.add_tensor(name, values.astype(np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    adapter = random_adapter(model, tmp_path / "adapter.gguf", rank=2, targets=["q", "k"])
    plan = plan_merge(model, adapter, tmp_path / "merged.gguf", "q8_0")
    assert plan.notes == ("blk.0.attn_q.weight: rows of 48 values are not whole Q8_0 blocks of 32, written as F16",)
    merged = GGUFFile(write_merged(plan)).tensors
    assert (merged["blk.0.attn_q.weight"].qtype, merged["blk.0.attn_k.weight"].qtype) == (QT.F16, QT.Q8_0)
    lora = read_adapter(adapter)
    expected = weights["blk.0.attn_q.weight"] + plan.scale * lora.tensors["blk.0.attn_q.weight"].b @ lora.tensors["blk.0.attn_q.weight"].a
    np.testing.assert_allclose(merged["blk.0.attn_q.weight"].data, expected, atol=2e-3)  # f16 rounding


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*RETROGRAD, "merge", *map(str, args)], capture_output=True, text=True, check=False)


def test_cli_merges_and_says_what_it_wrote(tiny):
    folder, model, adapter, _ = tiny
    out = folder / "cli.gguf"
    r = run("--model", model, "--adapter", adapter, "--out", out, "--type", "q8_0")
    assert r.returncode == 0, r.stderr
    assert f"merged {len(read_adapter(adapter).tensors)} weights (Q8_0, scale 2)" in r.stdout and str(out) in r.stdout
    assert out.stat().st_mode & 0o044  # readable like any file the user writes, not a 0600 temporary


def test_bad_input_is_one_line_exit_2_and_nothing_written(tiny, tiny_model):
    folder, model, adapter, _ = tiny
    other_arch = random_adapter(model, folder / "qwen2-named.gguf", arch="qwen2")
    loaded = read_adapter(adapter)
    name = next(iter(loaded.tensors))
    narrow = {n: LoRAWeights(w.a[:, :32], w.b) if n == name else w for n, w in loaded.tensors.items()}
    narrow_shapes = {n: (w.b.shape[0], w.a.shape[1]) for n, w in narrow.items()}
    mismatched = write_adapter(folder / "narrow.gguf", narrow, arch="llama", alpha=16.0, base_shapes=narrow_shapes)
    text = folder / "notes.txt"
    text.write_text("not a model\n")
    out = folder / "refused.gguf"
    cases = [
        (("--model", folder / "absent.gguf", "--adapter", adapter), "absent.gguf: no such file"),
        (("--model", text, "--adapter", adapter), "not a GGUF file"),
        (("--model", model, "--adapter", model), "not a LoRA adapter"),
        (("--model", model, "--adapter", other_arch), "made for architecture 'qwen2', but the base model"),
        (("--model", model, "--adapter", mismatched), f"{name}: lora_a [8, 32] / lora_b"),
        (("--model", model, "--adapter", adapter, "--type", "q4_k"), "--type 'q4_k': expected one of f16, bf16, q8_0, same"),
        (("--model", tiny_model("qwen3"), "--adapter", adapter), "made for architecture 'llama'"),
    ]
    for args, needle in cases:
        r = run(*args, "--out", out)
        assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    r = run("--model", model, "--adapter", adapter, "--out", model)
    assert r.returncode == 2 and "is the base model (--model)" in r.stderr, r.stderr
    assert sorted(p.name for p in folder.iterdir() if "refused" in p.name) == []


def test_output_kind_model_config():
    doc = {"run": {"algorithm": "sft"}, "sft": {"data": "d.jsonl"}}
    cfg = parse_config(doc | {"output": {"path": "out/m.gguf", "kind": "model", "merge_type": "same"}}, Path("/tmp/run.toml"))
    assert (cfg.output.kind, cfg.output.merge_type) == ("model", "same")
    assert cfg.output.adapter_path == Path("/tmp/out/m.lora.gguf")
    default = parse_config(doc | {"output": {"path": "out/a.gguf"}}, Path("/tmp/run.toml")).output
    assert (default.kind, default.adapter_path) == ("adapter", Path("/tmp/out/a.gguf"))
    for output, needle in [
        ({"path": "a.gguf", "merge_type": "f16"}, "output.merge_type applies to kind = 'model'"),
        ({"path": "a.gguf", "kind": "model", "merge_type": "q4_k"}, "output.merge_type"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            parse_config(doc | {"output": output}, Path("/tmp/run.toml"))


def test_sft_with_kind_model_writes_the_merged_model_and_the_adapter(tiny_model, tmp_path):
    model = tiny_model("llama")
    write_chat(tmp_path / "train.jsonl", 8, seed=0)
    (tmp_path / "run.toml").write_text(
        f"""
[run]
algorithm = "sft"
[model]
path = "{model}"
[output]
path = "out/merged.gguf"
kind = "model"
merge_type = "same"
[lora]
rank = 4
alpha = 8.0
dtype = "f32"
[training]
ctx = 64
micro_batch = 128
lr = 5e-3
compute_dtype = "f32"
threads = 2
[sft]
data = "train.jsonl"
"""
    )
    lines = []
    reporter = SilentReporter()
    reporter.message = lines.append
    result = sft.run(load_config(tmp_path / "run.toml"), reporter)
    merged, adapter = tmp_path / "out/merged.gguf", tmp_path / "out/merged.lora.gguf"
    assert result.output == merged and f"adapter: {adapter}" in lines and f"merged model (same weights): {merged}" in lines
    ids = ids_of(model)
    reference = llama_logits(model, ids, lora_path=adapter)
    assert (llama_logits(merged, ids) - reference).abs().max().item() < 1e-4
    assert (llama_logits(model, ids) - reference).abs().max().item() > 1e-3  # training moved the adapter off zero
