"""The Typer app every command module registers itself on, and `main`, which first restarts
the command on jemalloc where the system has it (runtime/allocator.py), then turns a
RetrogradError or a usage error into one `error: ...` line on stderr and exit code 2
(RETROGRAD_DEBUG=1 shows the traceback)."""

from __future__ import annotations

import os
import sys

import typer

from retrograd.errors import RetrogradError
from retrograd.runtime.allocator import restart_on_jemalloc

app = typer.Typer(
    name="retrograd",
    help="Fine-tune the GGUF model you already run: LoRA on the frozen base, exported for llama.cpp.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def main() -> None:
    try:
        restart_on_jemalloc()
        code = app(args=sys.argv[1:], standalone_mode=False)
    except RetrogradError as e:
        if os.environ.get("RETROGRAD_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))  # 2: bad input; TrainingDiverged says 1
    except typer.TyperException as e:  # usage errors (typer's own click)
        print(f"error: {e.format_message()} (see retrograd --help)", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except (KeyboardInterrupt, typer.Abort):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
