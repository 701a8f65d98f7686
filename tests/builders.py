"""Builders for conversations in tests: short, explicit, no hidden defaults that matter."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import anyio

from pipeline import Message, Usage
from pipeline.results.keys import result_key, tool_use_id_of


def tool_use(tool_use_id: str, name: str = "Bash", **inp: Any) -> dict[str, Any]:
    """A tool_use block."""
    return {"type": "tool_use", "id": tool_use_id, "name": name, "input": inp or {"command": "x"}}


def tool_result(tool_use_id: str, content: Any, **extra: Any) -> dict[str, Any]:
    """A tool_result block."""
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, **extra}


def user_text(text: str) -> Message:
    """A user prompt."""
    return Message.user(text)


def assistant(message_id: str, *blocks: dict[str, Any], usage: Usage | None = None) -> Message:
    """One assistant record (a fragment of response ``message_id``)."""
    return Message.assistant(list(blocks), message_id=message_id, usage=usage, model="claude-test")


def results(*blocks: dict[str, Any]) -> Message:
    """A user record holding tool_result blocks."""
    return Message.user(list(blocks))


def json_paths(node: Any, prefix: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every place in a JSON tree a value sits (containers included), as key/index paths."""
    if prefix:
        yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from json_paths(v, (*prefix, i))


# -- the ledger (``ReplacementState``): keys are ``<tool_use_id>#<digest of the output>`` --------


def key(tool_use_id: str, core: Any) -> str:
    """The ledger key of the result ``tool_use_id`` whose output (its content less any harness
    tail: see :mod:`pipeline.wire.harness`) is ``core``."""
    return result_key(tool_use_id, core)


def ids(keys: Iterable[str]) -> set[str]:
    """The tool_use_ids of ledger keys (a set: check the number of keys too where two results
    may share an id)."""
    return {tool_use_id_of(k) for k in keys}


def by_id(by_key: Mapping[str, str]) -> dict[str, str]:
    """A ledger map (key -> replacement) keyed by tool_use_id; two keys with one id are an
    error (a map by id could not tell them apart)."""
    out: dict[str, str] = {}
    for k, v in by_key.items():
        tid = tool_use_id_of(k)
        assert tid not in out, f"two ledger keys for the id {tid!r}: {sorted(by_key)}"
        out[tid] = v
    return out


class HostileSummarizer:
    """A summariser answering what a summariser must not: ``reply`` (not text), or never
    (``hang``); ``asked`` counts its requests."""

    def __init__(self, reply: Any = None, *, hang: bool = False) -> None:
        self.reply, self.hang, self.asked = reply, hang, 0

    async def summarize(self, messages: Sequence[Any]) -> Any:
        self.asked += 1
        if self.hang:
            await anyio.sleep_forever()
        return self.reply
