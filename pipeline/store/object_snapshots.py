"""Compacted snapshots of a session's record objects, so a worker new to a conversation reads a
bounded number of objects instead of one per record.

A snapshot is an immutable object holding the records numbered ``first`` to ``last``, exactly
as a load reads them one after the other (each record's bytes, a line end added to one that
lacks it), under ``<records dir>-snapshots/<first:012d>-<last:012d>.jsonl``. Its content is a
function of its range alone (records are immutable), so two workers writing the same range
write the same bytes, and a create that finds the key taken is done.

Two kinds make a *chain*: a **base** (``first`` = 0) and a **delta** on it (``first`` = the
base's ``last`` + 1). After each call, the worker that served it writes a delta holding every
record since the base, or a new base once that delta would pass :data:`DELTA_BYTES`; a new
base removes the snapshots older than the chain it replaces. A joining worker lists the
snapshots (one request), reads the newest base and its newest delta (two objects), and lists
and reads the records after them: one or none when the serving worker has settled its last
call, so a join reads at most three objects whatever the conversation's length.

The bytes written grow with the conversation: a delta up to ``DELTA_BYTES`` per call, and a
new base -- every record so far -- each time the deltas reach it: over a 1,000-call
conversation whose records come to 1.5 MB, ~51 MB of snapshots, 51 KB a call on average, a
small part of the request the client sends that call (3 MB on average there).

Snapshots are a cache, never the only copy: the records stay, a load that finds no usable
chain (or loses a race with the removal of one) reads the records, and a worker that holds a
record only as part of a snapshot it read keeps that snapshot's bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DELTA_BYTES", "Chain", "choose_chain", "snapshot_name", "snapshots_dir"]

DELTA_BYTES = 64 * 1024
"""The size past which a worker writes a new base instead of a longer delta: the bytes a call
writes against how often the whole is written again (the total is least near the square root
of the conversation's bytes times a call's; ~64 KB suits calls of a few KB)."""

_NAME = re.compile(r"([0-9]{12})-([0-9]{12})\.jsonl")


def snapshots_dir(records_dir: str) -> str:
    """The key prefix of the snapshots of the records under ``records_dir`` (a sibling, so a
    listing of the records holds records only)."""
    return f"{records_dir}-snapshots"


def snapshot_name(first: int, last: int) -> str:
    """The object name of the snapshot of records ``first`` to ``last``."""
    return f"{first:012d}-{last:012d}.jsonl"


@dataclass(frozen=True, slots=True)
class Chain:
    """A base and its delta (the one reaching furthest) among a listing's snapshots."""

    base: str
    base_last: int
    delta: str | None
    last: int
    """The last record the chain holds (the delta's, else the base's)."""
    others: tuple[str, ...]
    """The listed snapshots outside the chain (only names this module gives)."""


def choose_chain(keys: Iterable[str], directory: str) -> Chain | None:
    """The chain to load from ``keys`` (a listing of ``directory``): the one reaching the
    furthest record, with the newest base of those; None when no base was listed. Names this
    module never gives are left out (and are never removed)."""
    head = directory + "/"
    ranges: dict[str, tuple[int, int]] = {}
    for key in keys:
        match = _NAME.fullmatch(key[len(head) :]) if key.startswith(head) else None
        if match is not None and int(match[1]) <= int(match[2]):
            ranges[key] = (int(match[1]), int(match[2]))
    bases = [(last, key) for key, (first, last) in ranges.items() if first == 0]
    if not bases:
        return None
    chains = []
    for base_last, base in bases:
        deltas = [(last, key) for key, (first, last) in ranges.items() if first == base_last + 1]
        delta_last, delta = max(deltas) if deltas else (base_last, None)
        chains.append((delta_last, base_last, base, delta))
    # the chain that reaches furthest; of those, the one with the newest base (least to read)
    last, base_last, base, delta = max(chains, key=lambda c: (c[0], c[1]))
    others = tuple(sorted(k for k in ranges if k not in (base, delta)))
    return Chain(base, base_last, delta, last, others)
