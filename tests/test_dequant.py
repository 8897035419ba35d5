"""Every block dequantizer, the torch codecs and the C loops, equals gguf.quants.dequantize bit for bit."""

import ctypes
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from retrograd.kernels import native_dequant
from retrograd.kernels.dequant import CODECS, dequantize
from retrograd.kernels.frozen import FrozenWeight, frozen_linear
from retrograd.runtime import native

# byte ranges holding float16 scales in each block: random bytes there could be NaN/inf
F16_FIELDS = {
    QT.Q8_0: [(0, 2)], QT.Q4_0: [(0, 2)], QT.Q4_1: [(0, 4)], QT.Q5_0: [(0, 2)], QT.Q5_1: [(0, 4)],
    QT.Q4_K: [(0, 4)], QT.Q5_K: [(0, 4)], QT.Q6_K: [(208, 210)],
}
REQUIRED = {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K}


def random_blocks(qtype: QT, n_blocks: int, rng) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype == QT.F32:
        return rng.standard_normal(n_blocks * block_size).astype(np.float32).view(np.uint8).reshape(n_blocks, -1)
    if qtype == QT.F16:
        return rng.standard_normal(n_blocks * block_size).astype(np.float16).view(np.uint8).reshape(n_blocks, -1)
    if qtype == QT.BF16:
        f32 = rng.standard_normal(n_blocks * block_size).astype(np.float32)
        return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, -1)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for lo, hi in F16_FIELDS[qtype]:
        scales = (rng.standard_normal((n_blocks, (hi - lo) // 2)) * 0.05).astype(np.float16)
        raw[:, lo:hi] = scales.view(np.uint8)
    return raw


def test_required_types_have_torch_kernels():
    assert REQUIRED <= set(CODECS)


def test_the_c_loops_are_built_here():
    """CI's machines have a C compiler: a broken build must fail here, not fall back quietly."""
    assert all(native_dequant.available(q) for q in native_dequant.FUNCTIONS)


KERNELS = [(q, "torch") for q in sorted(CODECS, key=lambda q: q.value)] + [(q, "c") for q in native_dequant.FUNCTIONS]


@pytest.mark.parametrize(("qtype", "kernel"), KERNELS, ids=lambda v: getattr(v, "name", v))
def test_kernel_equals_gguf_dequantize(qtype, kernel):
    rng = np.random.default_rng(qtype.value)
    raw = random_blocks(qtype, 4099, rng)  # past the C loops' threading threshold (1024 blocks)
    expected = np.asarray(gguf.quants.dequantize(raw.reshape(-1), qtype), dtype=np.float32).reshape(-1)
    assert np.isfinite(expected).all()
    blocks = torch.from_numpy(raw)
    if kernel == "c":
        ours = native_dequant.dequantize_blocks(blocks, qtype).numpy().reshape(-1)
    else:
        ours = CODECS[qtype].dequantize_blocks(blocks).numpy().reshape(-1)
    bad = np.flatnonzero(ours.view(np.uint32) != expected.view(np.uint32))
    assert bad.size == 0, f"{bad.size} values differ, first at {bad[0]}: {ours[bad[0]]} vs {expected[bad[0]]}"


@pytest.mark.parametrize("qtype", sorted(CODECS, key=lambda q: q.value), ids=lambda q: q.name)
def test_kernel_keeps_to_the_blocks_device(qtype):
    """Blocks on another device (meta stands in for CUDA here) dequantize there: a constant
    made on the CPU (a shift table, say) raises, as it did for every quantized model on an H200."""
    raw = torch.from_numpy(random_blocks(qtype, 4, np.random.default_rng(0))).to("meta")
    out = dequantize(raw, qtype, (4 * GGML_QUANT_SIZES[qtype][0],))
    assert out.device.type == "meta" and out.shape == (4 * GGML_QUANT_SIZES[qtype][0],)


@pytest.mark.parametrize("qtype", native_dequant.FUNCTIONS, ids=lambda q: q.name)
def test_bf16_output_is_the_rounded_f32_output(qtype):
    """The C loops' bfloat16 output rounds each float32 value as torch does (ties to even)."""
    raw = torch.from_numpy(random_blocks(qtype, 4099, np.random.default_rng(qtype.value)))
    n = 4099 * GGML_QUANT_SIZES[qtype][0]
    f32 = dequantize(raw, qtype, (n,))
    bf16 = dequantize(raw, qtype, (n,), torch.bfloat16)
    rounded = f32.to(torch.bfloat16)
    bad = torch.nonzero(bf16.view(torch.int16) != rounded.view(torch.int16)).flatten()
    assert bad.numel() == 0, f"{bad.numel()} values differ, first at {bad[0]}: {bf16[bad[0]]} vs {rounded[bad[0]]} (from {f32[bad[0]]})"


def q5_1_weight(rows: int, cols: int, seed: int) -> FrozenWeight:
    raw = random_blocks(QT.Q5_1, rows * cols // 32, np.random.default_rng(seed)).reshape(rows, -1)
    return FrozenWeight("blk.0.attn_q.weight", torch.from_numpy(raw), QT.Q5_1, (rows, cols))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_linear_gradient_matches_dense_weight(dtype):
    rows, cols = 48, 64
    w = q5_1_weight(rows, cols, 1)
    dense = w.dense(dtype)
    x = torch.randn(5, cols, dtype=dtype, requires_grad=True)
    frozen_linear(x, w).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    (x2 @ dense.T).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    ids = torch.tensor([[3, 0], [47, 3]])
    torch.testing.assert_close(w.rows(ids, dtype), dense[ids], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_borrowed_rows_reuse_one_buffer_per_shape_and_thread(dtype):
    """borrow_rows gives row_range's values in a buffer the thread's next borrow of that
    shape overwrites (per-use matrices fragmented the heap); other threads have their own."""
    a, b = q5_1_weight(48, 64, 2), q5_1_weight(48, 64, 3)
    first = a.borrow_rows(8, 40, dtype)
    assert torch.equal(first, a.row_range(8, 40, dtype))
    second = b.borrow_rows(0, 32, dtype)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, b.row_range(0, 32, dtype))
    assert a.borrow_rows(0, 48, dtype).data_ptr() != first.data_ptr()  # another shape
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(a.borrow_rows(8, 40, dtype)))
    thread.start()
    thread.join()
    assert elsewhere[0].data_ptr() != first.data_ptr() and torch.equal(elsewhere[0], a.row_range(8, 40, dtype))
    assert torch.equal(second, b.row_range(0, 32, dtype))  # the thread wrote elsewhere


def test_loading_and_dequantizing_compile_nothing(smollm2, monkeypatch):
    """No torch.compile on the way to a first forward (a compile there cost a fresh install
    10 s of its first model load), in every weight mode: the C loops dequantize."""
    import retrograd

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called while loading")

    monkeypatch.setattr(torch, "compile", refuse)
    for weights in ("auto", "f32", "quantized"):
        model = retrograd.load_model(smollm2, weights=weights)
        assert model.weights_choice.startswith(("auto: dense", "f32", "quantized"))
        model.transformer(torch.arange(8))  # the embedding's rows come from its blocks, eagerly too


def test_without_a_compiler_the_torch_codecs_dequantize(monkeypatch):
    """$RETROGRAD_NO_COMPILE (or no C compiler) leaves the torch codecs, with the same bits."""
    raw = torch.from_numpy(random_blocks(QT.Q6_K, 2048, np.random.default_rng(3)))
    with_c = dequantize(raw, QT.Q6_K, (2048 * 256,))
    monkeypatch.setenv("RETROGRAD_NO_COMPILE", "1")
    native_dequant._library.cache_clear()
    try:
        assert not native_dequant.available(QT.Q6_K)
        assert torch.equal(dequantize(raw, QT.Q6_K, (2048 * 256,)), with_c)
    finally:
        native_dequant._library.cache_clear()


def test_a_library_is_built_per_cpu_and_falls_back_to_the_baseline(monkeypatch, tmp_path):
    """-march=native libraries are named by the CPU's features, so a cache shared with another
    CPU builds its own; a compiler that refuses the native flags builds the baseline, same bits."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cc = native.compiler()
    here = native.build("dequant", native_dequant.SOURCE, cc)
    monkeypatch.setattr(native, "cpu", lambda: "model name: another CPU\nflags: fpu sse2\n")
    monkeypatch.setattr(native, "NATIVE", ("-march=no-such-cpu",))
    baseline = native.build("dequant", native_dequant.SOURCE, cc)
    assert baseline != here and baseline.parent == here.parent == tmp_path / "retrograd"
    raw = torch.from_numpy(random_blocks(QT.Q4_0, 2048, np.random.default_rng(5)))
    outputs = []
    for lib in (here, baseline):
        native_dequant._library.cache_clear()
        monkeypatch.setattr(native, "build", lambda stem, source, cc, fma=False, lib=lib: lib)
        assert native_dequant._library() is not None  # the C pass runs, not torch's fallback
        outputs.append([dequantize(raw, QT.Q4_0, (2048 * 32,), dtype) for dtype in (torch.float32, torch.bfloat16)])
    native_dequant._library.cache_clear()
    for a, b in zip(*outputs):
        assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))


FUSED_OR_NOT = r"""
float multiply_add(float a, float b, float c) { return a * b + c; }
"""


@pytest.mark.skipif(" fma " not in native.cpu() + " ", reason="no FMA unit to fuse with")
def test_only_a_library_that_asks_for_it_fuses_multiply_adds(monkeypatch, tmp_path):
    """(1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 exactly, but 0 once the product is rounded: the
    libraries that give torch's bits round it, the gated product's (fma=True) does not."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a, c = 1 + 2**-12, -(1 + 2**-11)
    results = {}
    for fma in (False, True):
        lib = ctypes.CDLL(str(native.build("fused", FUSED_OR_NOT, native.compiler(), fma)))
        lib.multiply_add.argtypes, lib.multiply_add.restype = [ctypes.c_float] * 3, ctypes.c_float
        results[fma] = lib.multiply_add(a, a, c)
    assert results == {False: 0.0, True: 2**-24}


def test_a_compiler_that_refuses_gccs_flags_still_builds(monkeypatch, tmp_path):
    """clang rejects -fno-thread-jumps (GCC's pass, runtime/native.py): a compiler that calls
    itself clang builds without it, and its library gives the same bits."""
    cc = native.compiler()
    fake = tmp_path / "clang"
    fake.write_text(f"""#!/bin/sh
case "$*" in
  --version) echo "clang version 99 (a test double)"; exit 0;;
  *-fno-thread-jumps*) echo "clang: error: unknown argument: '-fno-thread-jumps'" >&2; exit 1;;
esac
exec {cc} "$@"
""")
    fake.chmod(0o755)
    assert not native.is_gcc(str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib = native.build("dequant", native_dequant.SOURCE, str(fake))
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 64, np.random.default_rng(6)))
    expected = dequantize(raw, QT.Q4_K, (64 * 256,), torch.float32)
    native_dequant._library.cache_clear()
    monkeypatch.setattr(native, "build", lambda stem, source, cc, fma=False: lib)
    try:
        assert native_dequant._library() is not None
        assert torch.equal(dequantize(raw, QT.Q4_K, (64 * 256,), torch.float32).view(torch.int32), expected.view(torch.int32))
    finally:
        native_dequant._library.cache_clear()
