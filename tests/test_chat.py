"""retrograd.serving.inference and `retrograd chat` on the bundled SmolLM2 with a LoRA that changes
its greedy answers: replies equal a fresh llama.cpp run with the same adapter (or none),
whatever was generated before, and the CLI scripts from a pipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lora_files import random_adapter

from retrograd.errors import GGUFError
from retrograd.gguf.adapter import read_adapter, read_fitting_adapter, write_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.runtime.llamacpp import C, llama_cpp
from retrograd.serving.inference import BASE, ContextFull, Inference, Settings

N_CTX = 512
QUESTION = "What is the capital of France?"
LONG_SYSTEM = "You answer questions about geography. " * 8  # the prompt spans more than one 64-token chunk


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory) -> Path:
    return random_adapter(smollm2, tmp_path_factory.mktemp("chat") / "tuned.gguf")


@pytest.fixture(scope="module")
def inference(smollm2, adapter):
    with Inference(smollm2, {"tuned": adapter}, n_ctx=N_CTX, n_threads=2) as inf:
        yield inf


def llama_greedy(model: Path, prompt: list[int], max_tokens: int, lora: Path | None = None) -> str:
    """A fresh llama-cpp-python run: greedy, stopping at end-of-generation, with llama.cpp's
    own sampler and the context settings retrograd.serving.inference uses (f16 KV, flash attention,
    prefill in 64-token ubatches)."""
    llm = llama_cpp.Llama(
        model_path=str(model),
        n_ctx=N_CTX,
        n_batch=64,
        n_ubatch=64,
        n_threads=2,
        flash_attn=True,
        verbose=False,
        lora_path=str(lora) if lora else None,
    )
    try:
        out: list[int] = []
        for token in llm.generate(prompt, temp=0.0):
            if C.llama_vocab_is_eog(llm._model.vocab, token) or len(out) == max_tokens:
                break
            out.append(token)
        return llm.detokenize(out).decode("utf-8", errors="replace")
    finally:
        llm.close()


def test_base_and_adapter_replies_equal_fresh_llama_runs_in_any_order(smollm2, adapter, inference):
    prompt = inference.chat_prompt([{"role": "user", "content": QUESTION}])
    expected = {BASE: llama_greedy(smollm2, prompt, 12), "tuned": llama_greedy(smollm2, prompt, 12, adapter)}
    assert expected[BASE] != expected["tuned"]  # the adapter changes what the model says
    for name in (BASE, "tuned", BASE, "tuned"):
        generation = inference.generate(name, prompt, Settings(max_tokens=12))
        pieces = list(generation)
        assert "".join(pieces) == generation.text == expected[name], name
        assert generation.prompt_tokens == len(prompt)
        assert generation.finish_reason == ("stop" if generation.completion_tokens < 12 else "length")


def test_a_continued_chat_reuses_its_cache_and_answers_as_a_fresh_run(smollm2, adapter, inference):
    history = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": QUESTION}]
    for turn in range(2):
        prompt = inference.chat_prompt(history)
        replies = {}
        for name, lora in ((BASE, None), ("tuned", adapter)):
            generation = inference.generate(name, prompt, Settings(max_tokens=8))
            replies[name] = generation.run()
            assert replies[name] == llama_greedy(smollm2, prompt, 8, lora), (turn, name)
            if turn:
                assert generation.reused >= 64  # the earlier turn's prefill was kept
        history += [{"role": "assistant", "content": replies["tuned"]}, {"role": "user", "content": "And of Italy?"}]


def test_seeded_sampling_repeats_and_stop_strings_cut_the_reply(inference):
    prompt = inference.chat_prompt([{"role": "user", "content": "Tell me about cats."}])
    hot = Settings(max_tokens=10, temperature=0.9, seed=7)
    assert inference.generate("tuned", prompt, hot).run() == inference.generate("tuned", prompt, hot).run()
    france = inference.chat_prompt([{"role": "user", "content": QUESTION}])
    whole = inference.generate("tuned", france, Settings(max_tokens=8)).run()
    assert "Paris" in whole
    cut = inference.generate("tuned", france, Settings(max_tokens=8, stop=("Paris",)))
    assert cut.run() == whole[: whole.index("Paris")] and cut.finish_reason == "stop"


def test_reply_ends_at_the_templates_end_of_turn_token(inference):
    im_end = inference.chat.tokenizer.encode("<|im_end|>", add_bos=False, special=True)
    assert len(im_end) == 1 and im_end[0] in inference.stop_ids
    generation = inference.generate("tuned", inference.chat_prompt([{"role": "user", "content": QUESTION}]))
    assert "<|im_end|>" not in generation.run() and generation.finish_reason == "stop"


def test_the_context_limit_is_a_length_finish_and_an_overlong_prompt_is_refused(inference):
    prompt = inference.text_prompt("one two three")
    generation = inference.generate(BASE, prompt)
    assert generation.budget == N_CTX - len(prompt)
    with pytest.raises(ContextFull, match="context holds 512"):
        inference.generate(BASE, [1] * N_CTX)


def mismatched(
    adapter: Path, dst: Path, *, arch: str | None = None, drop_rows: bool = False, on_norm: bool = False
) -> Path:
    """A copy of `adapter` made for another architecture, with lora_b one row short, or
    with one pair moved onto a norm (a vector in the base)."""
    loaded = read_adapter(adapter)
    tensors = dict(loaded.tensors)
    name = next(iter(tensors))
    if drop_rows:
        tensors[name] = type(tensors[name])(tensors[name].a, tensors[name].b[:-1])
    if on_norm:
        tensors["blk.0.attn_norm.weight"] = tensors.pop(name)
    shapes = {name: (w.b.shape[0], w.a.shape[1]) for name, w in tensors.items()}
    return write_adapter(dst, tensors, arch=arch or loaded.arch, alpha=loaded.alpha, base_shapes=shapes)


def test_adapters_that_do_not_fit_the_base_are_refused(smollm2, adapter, tmp_path):
    base = GGUFFile(smollm2)
    cases = [
        (tmp_path / "missing.gguf", "no such file"),
        (smollm2, "not a LoRA adapter"),
        (mismatched(adapter, tmp_path / "gemma.gguf", arch="gemma3"), "architecture 'gemma3'"),
        (mismatched(adapter, tmp_path / "short.gguf", drop_rows=True), "do not fit"),
        (mismatched(adapter, tmp_path / "norm.gguf", on_norm=True), "attn_norm.weight does not exist"),
    ]
    for path, message in cases:
        with pytest.raises(GGUFError, match=message):
            read_fitting_adapter(path, base)


def chat_cli(*args: str, stdin: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "retrograd", "chat", "--ctx", str(N_CTX), "--threads", "2", *args]
    return subprocess.run(command, input=stdin, check=False, capture_output=True, text=True, timeout=300)


def test_cli_compare_labels_both_answers_keeps_two_histories_and_resets(smollm2, adapter, inference):
    run = chat_cli(
        "--adapter",
        str(adapter),
        "--compare",
        "--max-tokens",
        "8",
        stdin=f"{QUESTION}\nAnd of Italy?\n/reset\n{QUESTION}\n",
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["base", "adapter"] * 3
    first = [{"role": "user", "content": QUESTION}]
    expected = {}
    for name, label in ((BASE, "base"), ("tuned", "adapter")):
        expected[label] = inference.generate(name, inference.chat_prompt(first), Settings(max_tokens=8)).run()
        second = first + [
            {"role": "assistant", "content": expected[label]},
            {"role": "user", "content": "And of Italy?"},
        ]
        expected[label + "2"] = inference.generate(name, inference.chat_prompt(second), Settings(max_tokens=8)).run()
    assert lines == [
        f"base: {expected['base']}",
        f"adapter: {expected['adapter']}",
        f"base: {expected['base2']}",
        f"adapter: {expected['adapter2']}",
        f"base: {expected['base']}",
        f"adapter: {expected['adapter']}",
    ]


def test_cli_with_a_system_message_prints_the_adapters_answer(smollm2, adapter):
    run = chat_cli("--adapter", str(adapter), "--system", LONG_SYSTEM, "--max-tokens", "8", stdin=QUESTION + "\n")
    assert run.returncode == 0, run.stderr
    with Inference(smollm2, n_ctx=N_CTX) as plain:
        prompt = plain.chat_prompt([{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": QUESTION}])
    assert run.stdout == llama_greedy(smollm2, prompt, 8, adapter) + "\n"


def test_cli_refuses_bad_adapters_and_compare_without_one_in_one_line(smollm2, adapter, tmp_path):
    cases = [
        (["--compare"], "--compare needs --adapter"),
        (["--adapter", str(tmp_path / "none.gguf")], "no such file"),
        (["--adapter", str(mismatched(adapter, tmp_path / "g.gguf", arch="gemma3"))], "architecture 'gemma3'"),
    ]
    for args, message in cases:
        run = chat_cli(*args, stdin="hi\n")
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: ") and message in run.stderr
