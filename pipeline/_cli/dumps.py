"""``--dump-requests``: each call's ``messages`` array, written as it was sent.

A long session's requests share almost everything with the call before, and their messages are
the same objects from call to call (``WireCache``). So each message is serialised once, when it
first appears, and a call's file is its fragments joined: the bytes are exactly those of
``json.dumps(request, ensure_ascii=False, indent=2)`` (ASCII-escaped instead when a lone
surrogate from an undecodable transcript byte cannot be encoded), at the cost of the new
messages. Two ways to keep a long session from writing gigabytes:

- ``--dump-calls 0,10-20``: only the calls named;
- ``--dump-format delta``: ``NNNN.json`` holds ``{"call": N, "prefix": K, "messages": [...]}``,
  the messages after the first ``K`` of the previous dumped call's request (which they extend):
  ``request(N) = request(previous)[:K] + messages``.

Each file is written to a temporary name and renamed into place: a full disk leaves no
truncated file under a call's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pipeline.kept_list import first_difference

__all__ = ["DumpFormat", "RequestDumper", "existing_dumps", "is_dump_name", "parse_calls"]

DumpFormat = Literal["full", "delta"]

_DUMP_NAME = re.compile(r"[0-9]{4,}\.json")


def is_dump_name(name: str) -> bool:
    """Whether ``name`` is one a dump may be written under (``NNNN.json``)."""
    return _DUMP_NAME.fullmatch(name) is not None


def existing_dumps(directory: Path) -> list[Path]:
    """The files in ``directory`` named as a dump names them (``NNNN.json``), sorted."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(directory / n for n in names if is_dump_name(n))


def _write_atomically(target: Path, data: bytes) -> None:
    """``target`` holds ``data`` or, on failure, is untouched (no temporary file is left)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def parse_calls(spec: str) -> frozenset[int]:
    """``"0,5,10-20"`` -> those call numbers; ``ValueError`` naming the bad part."""
    calls: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        first, sep, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise ValueError(f"{part!r} is not a call number or a range N-M") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{part!r} is not a call number or a range N-M (N <= M, from 0)")
        if hi - lo > 10_000_000:
            raise ValueError(f"{part!r} names too many calls")
        calls.update(range(lo, hi + 1))
    if not calls:
        raise ValueError("no call named")
    return frozenset(calls)


def _fragment(param: Any) -> bytes | None:
    """One message as it stands inside the indented array; None when it cannot be UTF-8."""
    text = "  " + json.dumps(param, ensure_ascii=False, indent=2).replace("\n", "\n  ")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


def _same_param(a: Any, b: Any) -> bool:
    """Two message params that serialise the same: one role, and one content string or the
    very same block objects."""
    if not (isinstance(a, dict) and isinstance(b, dict)) or a.get("role") != b.get("role"):
        return False
    ca, cb = a.get("content"), b.get("content")
    if isinstance(ca, str) or isinstance(cb, str):
        return isinstance(ca, str) and ca == cb and type(cb) is str
    if not (isinstance(ca, list) and isinstance(cb, list)) or len(ca) != len(cb):
        return False
    return first_difference(ca, cb) is None and set(a) == set(b) == {"role", "content"}


class RequestDumper:
    """Writes ``DIR/NNNN.json`` for each call it is given (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        calls: frozenset[int] | None = None,
        format: DumpFormat = "full",
    ) -> None:
        self.directory = directory
        self.calls = calls
        self.format = format
        self._params: list[Any] = []
        """The last request seen, and each message's fragment (same positions)."""
        self._fragments: list[bytes | None] = []
        self._dumped: list[bytes | None] | None = None
        """The fragments of the last call written (the base of the next delta)."""

    def wants(self, call: int) -> bool:
        """Whether ``call`` is to be written."""
        return self.calls is None or call in self.calls

    def dump(self, call: int, request: Sequence[Any]) -> None:
        """Write call ``call``'s request if it is wanted; raise ``OSError`` when it cannot."""
        if not self.wants(call):
            return
        frags = self._refresh(request)
        target = self.directory / f"{call:04d}.json"
        if self.format == "delta":
            data = self._delta(call, request, frags)
        elif None in frags:
            data = json.dumps(list(request), indent=2).encode("ascii")
        else:
            data = b"[\n" + b",\n".join(frags) + b"\n]" if frags else b"[]"  # type: ignore[arg-type]
        self._dumped = frags
        _write_atomically(target, data)

    def _refresh(self, request: Sequence[Any]) -> list[bytes | None]:
        """The fragments of ``request``: the previous ones for the messages it still shares
        (the same objects at the same positions), new ones for the rest."""
        params, frags = self._params, self._fragments
        first = first_difference(request, params)
        same = min(len(request), len(params)) if first is None else first
        # the last messages of a request are the caller's own copies: same role, same blocks
        while same < min(len(request), len(params)) and _same_param(request[same], params[same]):
            params[same] = request[same]
            same += 1
        del params[same:], frags[same:]
        for param in request[same:]:
            params.append(param)
            frags.append(_fragment(param))
        return list(frags)

    def _delta(self, call: int, request: Sequence[Any], frags: list[bytes | None]) -> bytes:
        base = self._dumped or []
        first = first_difference(frags, base)
        prefix = min(len(frags), len(base)) if first is None else first
        while prefix < min(len(frags), len(base)) and frags[prefix] == base[prefix] is not None:
            prefix += 1
        if None in frags[:prefix]:  # no bytes to tell two unencodable messages apart
            prefix = frags.index(None)
        tail = frags[prefix:]
        if None in tail:
            return json.dumps(
                {"call": call, "prefix": prefix, "messages": list(request[prefix:])}, indent=2
            ).encode("ascii")
        head = f'{{\n  "call": {call},\n  "prefix": {prefix},\n  "messages": '.encode()
        body = b"[\n" + b",\n".join(tail) + b"\n]" if tail else b"[]"  # type: ignore[arg-type]
        return head + body.replace(b"\n", b"\n  ") + b"\n}"
