"""`retrograd tools list CONFIG.toml`: the tool catalogue an agent_grpo run would show its
model (the environment's toolsets, an http environment's and the mcp servers' tools) and the
hash that resume checks; no model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from retrograd.cli.app import app

tools_app = typer.Typer(help="The tools an agent_grpo run offers its model.", no_args_is_help=True)
app.add_typer(tools_app, name="tools")


@tools_app.command("list", epilog="Examples: retrograd tools list agent.toml | retrograd tools list agent.toml --json --no-connect")
def list_tools(
    config: Annotated[Path, typer.Argument(help="An agent_grpo run's TOML file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the catalogue as one JSON object.")] = False,
    no_connect: Annotated[bool, typer.Option("--no-connect", help="Do not contact an http environment or mcp servers: "
                                                                  "list the environment's own toolsets and name the servers.")] = False,
) -> None:
    """Print every toolset with its tools (id@version, the name the model calls, the first line
    of the description), which toolset scenarios get by default, and the catalogue's sha256."""
    from retrograd.cli.progress import ConsoleReporter
    from retrograd.config import load_config
    from retrograd.errors import ConfigError
    from retrograd.recipes.agent_grpo import ToolOptions

    cfg = load_config(config)
    if cfg.run.algorithm != "agent_grpo":
        raise ConfigError(f"{cfg.path}: run.algorithm = {cfg.run.algorithm!r}; only an agent_grpo run has tools")
    options = ToolOptions.from_config(cfg)
    servers = ([f"http environment {options.http.base_url}"] if options.http else []) + [
        f"mcp server {o.name} ({o.describe()})" for o in options.servers]
    if no_connect:
        _print(options.catalog, servers, as_json)
        return
    catalog, http, mcp = options.connect(ConsoleReporter())
    try:
        _print(catalog, [], as_json)
    finally:
        for client in (http, mcp):
            if client is not None:
                client.close()


def _print(catalog, not_connected: list[str], as_json: bool) -> None:
    if as_json:
        doc = {"signature": catalog.signature() if catalog else None, "not_connected": not_connected}
        if catalog is not None:
            doc |= {"default": catalog.default, "scenario_toolsets": list(catalog.scenario_toolsets),
                    "toolsets": {name: [t.key for t in toolset.tools] for name, toolset in catalog.toolsets.items()},
                    "tools": {t.key: {"name": t.name, "description": t.description, "input_schema": t.input_schema}
                              for t in catalog.tools.values()}}
        print(json.dumps(doc, indent=1))
        return
    if catalog is None:
        print("no tools of its own: no [agent.environment] with tools" + ("" if not_connected else " and no mcp servers"))
    else:
        for name, toolset in catalog.toolsets.items():
            role = " (default)" if name == catalog.default else " (a scenario may pick it)" if name in catalog.scenario_toolsets else ""
            print(f"toolset {name}{role}: {len(toolset.tools)} tool(s)")
            width = max((len(t.key) for t in toolset.tools), default=0)
            for t in toolset.tools:
                summary = t.description.strip().splitlines()[0] if t.description.strip() else ""
                print(f"  {t.key:<{width}}  {t.name}: {summary}" if summary else f"  {t.key:<{width}}  {t.name}")
    for line in not_connected:
        print(f"not connected (--no-connect): {line}")
    if catalog is not None:
        print(f"catalogue sha256: {catalog.signature()}" + (" (without the servers' tools)" if not_connected else ""))
