"""Hostile GGUF files: every malformed header gives one GGUFError line naming the file,
never a traceback, a hang or an allocation sized by what the file claims. Targeted cases
for each known hole, a seeded fuzz over a small valid model written by gguf's own writer,
and a few files through the real `retrograd inspect` under a memory and time limit."""

from __future__ import annotations

import random
import resource
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

from retrograd.errors import GGUFError
from retrograd.gguf.file import GGUFFile
from retrograd.model.capabilities import inspect_model

N_VOCAB, N_EMBD = 16, 32

# key -> (value, type, element type of an array); written in this order
METADATA = {
    "general.architecture": ("llama", VT.STRING, None),
    "general.name": ("small", VT.STRING, None),
    "general.alignment": (32, VT.UINT32, None),
    "llama.block_count": (1, VT.UINT32, None),
    "llama.context_length": (64, VT.UINT32, None),
    "llama.embedding_length": (N_EMBD, VT.UINT32, None),
    "llama.feed_forward_length": (64, VT.UINT32, None),
    "llama.attention.head_count": (2, VT.UINT32, None),
    "llama.attention.head_count_kv": ([1], VT.ARRAY, VT.INT32),  # per layer
    "llama.attention.layer_norm_rms_epsilon": (1e-5, VT.FLOAT32, None),
    "llama.rope.freq_base": (10000.0, VT.FLOAT32, None),
    "tokenizer.ggml.model": ("gpt2", VT.STRING, None),
    "tokenizer.ggml.tokens": ([f"t{i}" for i in range(N_VOCAB)], VT.ARRAY, VT.STRING),
    "tokenizer.ggml.merges": (["t 1"], VT.ARRAY, VT.STRING),  # so that llama.cpp loads the vocabulary
    "tokenizer.ggml.token_type": ([1] * N_VOCAB, VT.ARRAY, VT.INT32),
    "tokenizer.chat_template": ("{{ messages[0]['content'] }}", VT.STRING, None),
}


def write_small_model(path: Path, **replace) -> Path:
    """A valid one-layer llama with a Q8_0, an F16 and F32 tensors (about 4 KB); `replace`
    maps a key (dots as "__") to a new (value, type, element type)."""
    metadata = METADATA | {key.replace("__", "."): value for key, value in replace.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype, etype) in metadata.items():
        w.add_key_value(key, value, vtype, sub_type=etype)
    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal((N_VOCAB, N_EMBD)).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embeddings, QT.Q8_0), raw_dtype=QT.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(N_EMBD, np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((N_EMBD, N_EMBD)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- raw headers, for what no writer writes


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def string(text: str) -> bytes:
    return u64(len(text.encode())) + text.encode()


def kv(key: str, vtype: VT, payload: bytes) -> bytes:
    return string(key) + u32(vtype) + payload


def tensor_info(name: str, ne: list[int], qtype: QT, offset: int = 0) -> bytes:
    return string(name) + u32(len(ne)) + b"".join(map(u64, ne)) + u32(qtype) + u64(offset)


def raw_gguf(path: Path, kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"") -> Path:
    head = b"GGUF" + u32(3) + u64(len(infos)) + u64(len(kvs)) + b"".join(kvs) + b"".join(infos)
    path.write_bytes(head + bytes(-len(head) % 32) + data)
    return path


def nested_array(depth: int) -> bytes:
    """An array of one array of one ... of one uint8, `depth` arrays deep."""
    return (u32(VT.ARRAY) + u64(1)) * (depth - 1) + u32(VT.UINT8) + u64(1) + b"\x07"


# ---------------------------------------------------------------- what "fine or one line" means


def outcome(path: Path) -> str | None:
    """None when retrograd reads the file as `inspect` does (every key decoded too); else the
    GGUFError message, which must be one line naming the file. Anything else escapes."""
    try:
        f = GGUFFile(path)
        for key in f.keys():
            f.get(key)
        inspect_model(path, torch.device("cpu"))
    except GGUFError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{path}: "), message
        return message
    return None


def refused(path: Path, *needles: str) -> str:
    message = outcome(path)
    assert message is not None, f"{path.name} was accepted"
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    path = write_small_model(tmp_path_factory.mktemp("gguf") / "small.gguf")
    assert outcome(path) is None
    return path


# ---------------------------------------------------------------- the holes found, one by one


@pytest.mark.parametrize("depth", [2, 3000])
def test_arrays_of_arrays_are_refused_without_recursion(tmp_path, depth):
    path = raw_gguf(tmp_path / "nested.gguf", [kv("junk.nested", VT.ARRAY, nested_array(depth))])
    refused(path, "'junk.nested' is an array of arrays")


@pytest.mark.parametrize(
    "vtype,payload,shown",
    [
        (VT.STRING, string("abc"), "string"),
        (VT.UINT64, u64(32), "uint64"),  # llama.cpp refuses it too: it reads a uint32
        (VT.UINT32, u32(0), "0"),
        (VT.UINT32, u32(48), "48"),
    ],
    ids=["string", "uint64", "zero", "not-power-of-two"],
)
def test_alignment_is_a_uint32_power_of_two(tmp_path, vtype, payload, shown):
    path = raw_gguf(tmp_path / "align.gguf", [kv("general.alignment", vtype, payload)])
    refused(path, f"general.alignment is {shown}, expected a uint32 power of two")


@pytest.mark.parametrize(
    "ne,qtype,needle",
    [
        ([2**62, 4], QT.Q8_0, "more elements than int64 counts"),  # np.prod wrapped to 0: the tensor was accepted
        ([2**63], QT.F32, "more elements than int64 counts"),  # negative as llama.cpp's int64
        ([2**62, 0], QT.F16, "an empty dimension"),  # numpy cannot even shape a view of it
        ([32, 2**40], QT.F16, "truncated"),  # fits int64, not the file
    ],
)
def test_tensor_sizes_are_exact_and_inside_the_file(tmp_path, ne, qtype, needle):
    path = raw_gguf(tmp_path / "dims.gguf", infos=[tensor_info("token_embd.weight", ne, qtype)], data=bytes(64))
    refused(path, "'token_embd.weight'", needle)


def test_tensors_lie_in_order_without_overlap(tmp_path):
    infos = [tensor_info("a", [8], QT.F32, 0), tensor_info("b", [8], QT.F32, 0)]  # b would alias a
    refused(raw_gguf(tmp_path / "overlap.gguf", infos=infos, data=bytes(64)), "'b' starts at data offset 0, expected 32")
    infos = [tensor_info("a", [8], QT.F32, 4)]
    refused(raw_gguf(tmp_path / "unaligned.gguf", infos=infos, data=bytes(64)), "'a' starts at data offset 4, expected 0")


@pytest.mark.parametrize(
    "payload,needle",
    [
        (u32(VT.UINT8) + u64(2**63), "'junk.array' is an array of 9223372036854775808 elements"),
        (u32(VT.STRING) + u64(2**64 - 1), "'junk.array' is an array of 18446744073709551615 elements"),
        (u32(VT.INT64) + u64(2**30 + 1), "(at most 1073741824)"),  # llama.cpp's limit
        (u32(VT.STRING) + u64(3) + u64(2**63) + b"x", "truncated header (a string at byte 58 runs past the end of the file)"),
    ],
    ids=["uint8s", "strings", "int64s", "string-length"],
)
def test_huge_counts_and_lengths_are_refused_before_allocating(tmp_path, payload, needle):
    refused(raw_gguf(tmp_path / "count.gguf", [kv("junk.array", VT.ARRAY, payload)]), needle)


def test_metadata_arrays_are_decoded_only_when_read(tmp_path):
    """An 8 MB array costs nothing to open (it was 64 MB of Python ints) and still reads back."""
    n = 8 * 2**20
    junk = np.arange(n, dtype=np.uint64).astype(np.uint8).tobytes()
    path = raw_gguf(tmp_path / "big.gguf", [kv("junk.bytes", VT.ARRAY, u32(VT.UINT8) + u64(n) + junk)])
    tracemalloc.start()
    try:
        f = GGUFFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"opening took {peak / 2**20:.1f} MiB of heap"
    assert f.array_length("junk.bytes") == n and f.get("junk.bytes")[250:258] == [250, 251, 252, 253, 254, 255, 0, 1]


@pytest.mark.parametrize(
    "replace,needle",
    [
        ({"llama__block_count": ("abc", VT.STRING, None)}, "llama.block_count is string, expected an integer"),
        ({"llama__attention__head_count": (0, VT.UINT32, None)}, "llama.attention.head_count is 0, expected 1 to"),
        ({"llama__block_count": (2**31 - 1, VT.UINT32, None)}, "block_count is 2147483647, but the file has only 4 tensors"),
        ({"llama__embedding_length": (2**40, VT.UINT64, None)}, "llama.embedding_length is 1099511627776, expected 1 to"),
        ({"llama__attention__head_count_kv": ([1, 1, 1], VT.ARRAY, VT.INT32)}, "head_count_kv has 3 entries for 1 layers"),
        ({"llama__attention__layer_norm_rms_epsilon": (float("nan"), VT.FLOAT32, None)}, "layer_norm_rms_epsilon is nan"),
        ({"llama__rope__freq_base": (10000, VT.UINT32, None)}, "llama.rope.freq_base is uint32, expected a float"),
        ({"tokenizer__chat_template": (7, VT.INT32, None)}, "tokenizer.chat_template is int32, expected a string"),
        ({"general__architecture": (["llama"], VT.ARRAY, VT.STRING)}, "general.architecture is an array of 1 string"),
        ({"tokenizer__ggml__tokens": ([0] * N_VOCAB, VT.ARRAY, VT.UINT8)}, "tokens is an array of 16 uint8, expected an array of str"),
        # llama.cpp would abort the process (GGML_ASSERT) on a token listed twice
        ({"tokenizer__ggml__tokens": (["a", "b", "a"] + [f"t{i}" for i in range(3, N_VOCAB)], VT.ARRAY, VT.STRING)},
         "tokenizer.ggml.tokens lists the token 'a' 2 times"),
    ],
)
def test_metadata_we_read_is_typed_and_bounded(tmp_path, replace, needle):
    refused(write_small_model(tmp_path / "typed.gguf", **replace), needle)


# ---------------------------------------------------------------- seeded fuzz of the small model


WRONG_VALUES = [
    ("abc", VT.STRING, None),
    (2**64 - 1, VT.UINT64, None),
    (-1, VT.INT32, None),
    (float("nan"), VT.FLOAT32, None),
    (True, VT.BOOL, None),
    (["x", "y"], VT.ARRAY, VT.STRING),
    ([0, 0, 0], VT.ARRAY, VT.UINT8),
]


def header_mutations(good: bytes, end: int) -> list[bytes]:
    """Seeded: a few random bytes of the header changed, cuts at many offsets, and every
    count, length, dimension and offset (and a few look-alikes) made huge."""
    rng = random.Random(1234)
    cases = []
    for _ in range(1000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(4, end)] = rng.randrange(256)
        cases.append(bytes(data))
    cases += [good[:cut] for cut in [*range(1, end + 64, 3), *range(end + 64, len(good), 50)]]
    small_u64s = [i for i in range(4, end - 8) if 0 < int.from_bytes(good[i : i + 8], "little") < 2**16]
    cases += [good[:i] + u64(huge) + good[i + 8 :] for i in small_u64s for huge in (2**63, 2**64 - 1, 2**31)]
    return cases


# Loads each file's vocabulary with llama.cpp; a GGML_ASSERT there would kill the process.
LLAMA_LOADS = """
import sys
from retrograd.errors import GGUFError
from retrograd.model.tokenizer import Tokenizer
for path in sys.argv[1:]:
    try:
        Tokenizer(path)
    except GGUFError:
        pass
"""


def test_fuzzed_headers_open_or_give_one_line(tmp_path, small):
    """Each mutated header, and each known key given a value of the wrong type, reads fine
    or raises one GGUFError line (anything else fails); and llama.cpp, which loads a file
    after us, survives every file we accept (it aborted on a vocabulary with a duplicate)."""
    good = small.read_bytes()
    end = gguf.GGUFReader(small).data_offset  # metadata and tensor infos lie before it
    messages, accepted = [], []
    for n, data in enumerate(header_mutations(good, end)):
        path = tmp_path / f"case{n}.gguf"
        path.write_bytes(data)
        messages.append(outcome(path))
        if messages[-1] is None:
            accepted.append(path)
        else:
            path.unlink()
    for key in METADATA:
        for value in WRONG_VALUES:
            path = write_small_model(tmp_path / "typed.gguf", **{key.replace(".", "__"): value})
            messages.append(outcome(path))
    n_refused = sum(m is not None for m in messages)
    assert len(messages) > 1000 and 0.3 * len(messages) < n_refused < len(messages), (len(messages), n_refused)
    r = subprocess.run([sys.executable, "-c", LLAMA_LOADS, *accepted], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])


# ---------------------------------------------------------------- through the real command

CLI_LIMIT_BYTES = 3 * 2**29  # 1.5 GiB of address space


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (CLI_LIMIT_BYTES, CLI_LIMIT_BYTES))


def test_inspect_command_refuses_hostile_files_in_one_line(tmp_path, small):
    retrograd = Path(sys.executable).with_name("retrograd")
    files = {
        "valid": small,
        "nested": raw_gguf(tmp_path / "nested.gguf", [kv("junk.nested", VT.ARRAY, nested_array(3000))]),
        "alignment": raw_gguf(tmp_path / "align.gguf", [kv("general.alignment", VT.STRING, string("abc"))]),
        "dims": raw_gguf(tmp_path / "dims.gguf", infos=[tensor_info("token_embd.weight", [2**62, 4], QT.Q8_0)]),
        "tokens": write_small_model(tmp_path / "tokens.gguf", tokenizer__ggml__tokens=(["a"] * N_VOCAB, VT.ARRAY, VT.STRING)),
        "type": write_small_model(tmp_path / "typed.gguf", llama__block_count=("abc", VT.STRING, None)),
    }
    for case, path in files.items():
        r = subprocess.run([retrograd, "inspect", "--model", path], capture_output=True, text=True,
                           timeout=30, preexec_fn=_limit_memory)
        if case == "valid":
            assert r.returncode == 0 and "architecture   llama (small)" in r.stdout, r.stderr
            continue
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {path}: "), (case, r.stderr)
