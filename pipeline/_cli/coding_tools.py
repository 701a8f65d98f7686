"""The two tools of the small CLI coding agent: ``bash`` and ``read_file``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import anyio

from pipeline.store.readback import LineReader, PagedReader
from pipeline.tools import Tool

__all__ = ["BASH_DECLARED_LIMIT", "bash_tool", "read_file_tool", "run_shell"]

BASH_DECLARED_LIMIT = 30_000
"""Shell output above this is persisted (the reference value for a shell tool)."""

_READ_BYTES = 1 << 16
_DRAIN_BYTES = 1 << 22
"""After the shell exits, at most this much more output is taken from the pipe: a process that
left the shell's process group (``setsid``) could keep writing to it forever."""


def read_file_tool(
    cwd: Path, store_directory: Path | None = None, *, store_reader: PagedReader | None = None
) -> Tool:
    """``read_file {path, offset?, limit?}``: files under ``cwd`` and persisted outputs --
    files under ``store_directory``, or, with ``store_reader``, the object store URIs
    (``s3://...``) it reads.

    Never persisted (``math.inf``): persisting the output of the tool that reads persisted
    outputs would be a loop; its own per-call character bound applies instead. A bad path or
    page of any kind raises :class:`~pipeline.store.readback.ReadbackError` only, and memory stays
    bounded whatever the file (see :class:`~pipeline.store.readback.LineReader`).
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
    if store_reader is None:
        return reader.as_tool()
    objects = store_reader

    async def read(tool_input: dict[str, Any]) -> str:
        path = tool_input.get("path")
        # a URI names a persisted output on the store; anything else is a local file
        chosen = objects if isinstance(path, str) and "://" in path else reader
        return await chosen(tool_input)

    return dataclasses.replace(reader.as_tool(), handler=read)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process left in the group ``pgid``; an empty group is fine."""
    # ESRCH: nothing left; EPERM: only zombies left (BSDs answer so)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_ready(fd: int, sink: bytearray, limit: int) -> bool:
    """Append what the non-blocking ``fd`` holds now, up to about ``limit`` bytes.

    Returns False once every writer has closed the pipe (EOF), True otherwise.
    """
    taken = 0
    while taken < limit:
        try:
            chunk = os.read(fd, _READ_BYTES)
        except BlockingIOError:  # nothing more right now
            return True
        if not chunk:
            return False
        sink += chunk
        taken += len(chunk)
    return True


async def _collect(fd: int, sink: bytearray) -> None:
    """Read the pipe into ``sink`` until EOF (or until cancelled)."""
    while True:
        await anyio.wait_readable(fd)
        # one read per wake-up: a fast writer must not keep the event loop (and the
        # timeout) from running
        if not _read_ready(fd, sink, _READ_BYTES):
            return


async def run_shell(command: str, cwd: Path, *, timeout: float) -> str:
    """Run ``bash -c command`` in ``cwd``: stdout and stderr together, then the exit code.

    The shell gets its own session, so it and everything it starts form one process group.
    The call returns when the shell exits, not when the output pipe reaches EOF: a background
    child (``server &``) would hold the pipe open forever. The group is then killed, so no
    child outlives the call (only one that called ``setsid`` itself escapes), and the output
    already in the pipe is taken without waiting for more. After ``timeout`` seconds the group
    is killed and the output so far is returned with a note saying so; a cancelled call kills
    the group too. stdin is ``/dev/null``: nobody is there to type.
    """
    read_fd, write_fd = os.pipe()
    try:
        try:
            process = await anyio.open_process(
                ["bash", "-c", command],
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=write_fd,
                stderr=write_fd,
                env={**os.environ, "PAGER": "cat"},
                start_new_session=True,
            )
        finally:
            os.close(write_fd)  # now only the shell and its children hold the write end
        os.set_blocking(read_fd, False)
        output = bytearray()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_collect, read_fd, output)
                with anyio.move_on_after(timeout) as deadline:
                    await process.wait()
                tg.cancel_scope.cancel()
        finally:
            _kill_group(process.pid)
            with anyio.CancelScope(shield=True):
                await process.wait()  # reaps the shell, which has exited or was just killed
        # what the shell and its killed children wrote is in the pipe already
        _read_ready(read_fd, output, _DRAIN_BYTES)
    finally:
        os.close(read_fd)
    out = output.decode("utf-8", errors="replace")
    if deadline.cancelled_caught:
        return (
            f"{out}\n[timed out after {timeout:g} s: the command and every process it "
            "started were killed]"
        )
    return out if process.returncode == 0 else f"{out}\n[exit code {process.returncode}]"


def bash_tool(cwd: Path, *, timeout: float = 120.0) -> Tool:
    """``bash {command}``: run a shell command in ``cwd``; stdout and stderr, then the exit code.

    Only register it when the user asked for it: it runs anything the model writes. The call
    ends when the shell exits; processes it left running are killed (see :func:`run_shell`).
    """

    async def run(tool_input: dict[str, Any]) -> str:
        command = tool_input.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("'command' must be a non-empty string")
        return await run_shell(command, cwd, timeout=timeout)

    return Tool(
        name="bash",
        description=(
            f"Run a bash command in {cwd} and return its output (timeout {timeout:g}s; "
            "background processes are killed when the command returns)."
        ),
        input_schema={
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command to run."}},
            "required": ["command"],
            "additionalProperties": False,
        },
        handler=run,
        max_result_size_chars=BASH_DECLARED_LIMIT,
    )
