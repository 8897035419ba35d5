"""Options shared by several commands, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from retrograd.runtime.http_guard import API_KEY_ENV

ModelOpt = Annotated[
    Optional[Path],
    typer.Option("--model", "-m", help="Base GGUF file (default: \\[model].path, else the bundled SmolLM2-135M-Instruct Q4_1)."),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (a CUDA GPU if torch sees one), cpu or gpu.")]
WeightsOpt = Annotated[
    str, typer.Option("--weights", help="auto (dense in the compute dtype when it fits half the free memory, else quantized), quantized (keep GGUF blocks, dequantize per matmul), bf16 or f32 (dequantize once).")
]
ComputeOpt = Annotated[str, typer.Option("--compute-dtype", help="Matmul precision: f32 or bf16.")]
ApiKeyOpt = Annotated[
    Optional[str],
    typer.Option(
        "--api-key",
        metavar="KEY",
        help=f"Answer only requests with 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, which other users "
        "cannot read in the process list, else none); required unless --host is loopback.",
    ),
]
