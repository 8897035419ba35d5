"""`retrograd chat`: talk to the base, the adapter, or both side by side (--compare), with
the GGUF's own chat template. From a pipe it answers one prompt per line, so it scripts.

With --compare each model keeps its own history: the base's replies go into the base's
conversation and the adapter's into the adapter's, so each side continues the chat it had."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli.app import app
from retrograd.cli.options import ModelOpt
from retrograd.errors import ConfigError

ChatTemplateOpt = Annotated[
    str | None,
    typer.Option(
        "--chat-template", help="chatml, gemma or a Jinja file (default: the GGUF's tokenizer.chat_template)."
    ),
]
CtxOpt = Annotated[int, typer.Option("--ctx", min=16, help="Context positions per model (capped at the model's own).")]
ThreadsOpt = Annotated[
    int, typer.Option("--threads", min=0, help="llama.cpp threads (0: every CPU this process may use).")
]
ADAPTER = "adapter"  # the model name of --adapter
STYLES = {"base": "\033[1;36m", ADAPTER: "\033[1;35m"}  # bold cyan / bold magenta labels on a terminal
RESET_STYLE = "\033[0m"


@app.command(
    epilog="Examples: retrograd chat --adapter out/adapter.gguf --compare | "
    "printf 'Hi\\nWhat is 2+2?\\n' | retrograd chat --adapter out/adapter.gguf --compare"
)
def chat(
    model: ModelOpt = None,
    adapter: Annotated[Path | None, typer.Option("--adapter", "-a", help="LoRA GGUF applied to the base.")] = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Answer every prompt with the base and with base+adapter.")
    ] = False,
    system: Annotated[str | None, typer.Option("--system", help="System message that opens the chat.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Most tokens per reply.")] = 512,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0: greedy, reproducible.")] = 0.0,
    seed: Annotated[
        int | None, typer.Option("--seed", min=0, help="Seed of every reply's sampling (temperature > 0).")
    ] = None,
    chat_template: ChatTemplateOpt = None,
    ctx: CtxOpt = 4096,
    threads: ThreadsOpt = 0,
) -> None:
    """Chat in the terminal with the model (and its adapter); /reset clears the history, /exit or Ctrl-D quits."""
    from retrograd.runtime.bundled import default_model_path
    from retrograd.serving.inference import BASE, ContextFull, Inference, Settings

    if compare and adapter is None:
        raise ConfigError("--compare needs --adapter: it answers each prompt with the base and with base+adapter")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    names = [BASE, ADAPTER] if compare else [ADAPTER if adapter else BASE]
    settings = Settings(max_tokens=max_tokens, temperature=temperature, seed=seed)
    opening = [{"role": "system", "content": system}] if system else []
    with Inference(
        model or default_model_path(),
        {ADAPTER: adapter} if adapter else {},
        n_ctx=ctx,
        n_threads=threads,
        chat_template=chat_template,
    ) as inference:
        inference.require_chat_template()
        if interactive:
            import readline  # noqa: F401  (line editing and history for input())

            print(
                f"chatting with {' and '.join(names)}; /reset clears the history, /exit or Ctrl-D quits",
                file=sys.stderr,
            )
        histories = {name: list(opening) for name in names}
        for line in _prompts(interactive):
            if line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                histories = {name: list(opening) for name in names}
                continue
            if not line.strip():
                continue
            for name in names:
                history = histories[name] + [{"role": "user", "content": line}]
                try:
                    generation = inference.generate(name, inference.chat_prompt(history), settings)
                except ContextFull as e:
                    if not interactive:
                        raise
                    print(f"{e}: /reset starts a new conversation", file=sys.stderr)
                    break
                _label(name, compare, interactive)
                try:
                    for piece in generation:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                except KeyboardInterrupt:  # Ctrl-C stops this reply; what was said stays in the history
                    if not interactive:
                        raise
                sys.stdout.write("\n")
                sys.stdout.flush()
                histories[name] = history + [{"role": "assistant", "content": generation.text}]


def _prompts(interactive: bool):
    """User lines until Ctrl-D (end of input)."""
    if not interactive:
        for line in sys.stdin:
            yield line.rstrip("\r\n")
        return
    while True:
        try:
            yield input("you › ")
        except EOFError:
            print(file=sys.stderr)
            return


def _label(name: str, compare: bool, interactive: bool) -> None:
    if interactive:
        sys.stdout.write(f"{STYLES[name]}{name} ›{RESET_STYLE} ")
    elif compare:
        sys.stdout.write(f"{name}: ")
