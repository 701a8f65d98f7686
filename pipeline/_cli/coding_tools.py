"""The two tools of the small CLI coding agent: ``bash`` and ``read_file``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import anyio

from pipeline.readback import LineReader
from pipeline.tools import Tool

__all__ = ["BASH_DECLARED_LIMIT", "bash_tool", "read_file_tool"]

BASH_DECLARED_LIMIT = 30_000
"""Shell output above this is persisted (the reference value for a shell tool)."""


def read_file_tool(cwd: Path, store_directory: Path | None = None) -> Tool:
    """``read_file {path, offset?, limit?}``: files under ``cwd`` and persisted outputs.

    Never persisted (``math.inf``): persisting the output of the tool that reads persisted
    outputs would be a loop; its own per-call character bound applies instead.
    """
    roots = [cwd] + ([store_directory] if store_directory is not None else [])
    reader = LineReader(
        roots,
        name="read_file",
        description=(
            "Read a text file in the working directory, or a saved tool output (the path after "
            "'Full output saved to:' in a <persisted-output> block)."
        ),
    )
    return reader.as_tool()


def bash_tool(cwd: Path, *, timeout: float = 120.0) -> Tool:
    """``bash {command}``: run a shell command in ``cwd``; stdout and stderr, then the exit code.

    Only register it when the user asked for it: it runs anything the model writes.
    """

    async def run(tool_input: dict[str, Any]) -> str:
        command = tool_input.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("'command' must be a non-empty string")
        with anyio.fail_after(timeout):
            done = await anyio.run_process(
                ["bash", "-c", command],
                cwd=cwd,
                check=False,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PAGER": "cat"},
            )
        out = done.stdout.decode("utf-8", errors="replace")
        return out if done.returncode == 0 else f"{out}\n[exit code {done.returncode}]"

    return Tool(
        name="bash",
        description=f"Run a bash command in {cwd} and return its output (timeout {timeout:g}s).",
        input_schema={
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
            "additionalProperties": False,
        },
        handler=run,
        max_result_size_chars=BASH_DECLARED_LIMIT,
    )
