"""The bytes of an object-store record log that one process holds (:class:`HeldRecords`).

A log's records are numbered objects, ``<records dir>/<number:012d>.jsonl``. A process holds
those from number 0 on without a gap as *pieces* -- one record object's bytes, or a snapshot's,
which holds a run of them (:mod:`pipeline.store.object_snapshots`) -- and, apart, the records
it read or wrote past a gap (another writer's record it could not read yet). Loading reads the
pieces in order then the rest; a snapshot is written from the pieces.
"""

from __future__ import annotations

import bisect
import re

__all__ = ["RECORD_NAME", "HeldRecords", "line_ended", "record_number"]

RECORD_NAME = re.compile(r"([0-9]{12})\.jsonl")
"""A record object's name within its directory."""


def record_number(key: str) -> int:
    """The number of record ``key`` (-1 for a name records never have)."""
    match = RECORD_NAME.fullmatch(key.rsplit("/", 1)[-1])
    return int(match[1]) if match is not None else -1


def line_ended(data: bytes) -> bytes:
    """A record object's bytes as a load reads them: a torn object must not swallow the next
    one's first line."""
    return data if not data or data.endswith(b"\n") else data + b"\n"


class HeldRecords:
    """The records of the log under ``records_dir`` that this process holds. Not thread-safe:
    the log calls it under its lock."""

    def __init__(self, records_dir: str) -> None:
        self.records_dir = records_dir
        self._pieces: list[tuple[int, bytes, str]] = []
        """(the last record a piece holds, its bytes as loaded, the object they came from)."""
        self._ends: list[int] = []
        """Each piece's last record, ascending."""
        self._beyond: dict[str, bytes] = {}
        """Records held past a gap, by key."""

    def key(self, number: int) -> str:
        """The key of record ``number``."""
        return f"{self.records_dir}/{number:012d}.jsonl"

    @property
    def last(self) -> int:
        """The last record held without a gap from 0 (-1 for none)."""
        return self._ends[-1] if self._ends else -1

    @property
    def empty(self) -> bool:
        """Whether nothing at all is held."""
        return not self._ends and not self._beyond

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return key in self._beyond or 0 <= record_number(key) <= self.last

    def add(self, key: str, data: bytes) -> None:
        """Hold record ``key``, and move what now follows the pieces without a gap into them."""
        self._beyond[key] = data
        while (next_key := self.key(self.last + 1)) in self._beyond:
            self._pieces.append((self.last + 1, line_ended(self._beyond.pop(next_key)), next_key))
            self._ends.append(self.last + 1)

    def ends_at(self, number: int) -> bool:
        """Whether a piece ends at record ``number`` (-1: before the first, always)."""
        at = bisect.bisect_left(self._ends, number)
        return number == -1 or (at < len(self._ends) and self._ends[at] == number)

    def since(self, number: int) -> list[bytes] | None:
        """The pieces after the one that ends at ``number`` (None when none does)."""
        if not self.ends_at(number):
            return None
        return [
            data for _last, data, _key in self._pieces[bisect.bisect_right(self._ends, number) :]
        ]

    def whole(self) -> bytes:
        """Every piece's bytes, in order: records 0 to :attr:`last`."""
        return b"".join(data for _last, data, _key in self._pieces)

    def take(self, base_last: int, pieces: list[tuple[int, bytes, str]]) -> None:
        """Hold a snapshot chain: the pieces up to the one ending at ``base_last`` (-1: none)
        stay, ``pieces`` follow them (a base, a delta: see ``ends_at`` first). Records past
        the chain that were held stay held; a chain that reaches no further than the pieces
        held changes nothing."""
        if not pieces or pieces[-1][0] <= self.last:
            return
        kept = bisect.bisect_right(self._ends, base_last)
        self._pieces = self._pieces[:kept] + pieces
        self._ends = [last for last, _data, _key in self._pieces]
        for key in [k for k in self._beyond if record_number(k) <= self.last]:
            del self._beyond[key]
        following = self.key(self.last + 1)
        if following in self._beyond:  # it and what follows it join the pieces
            self.add(following, self._beyond.pop(following))

    def fold(self, last: int, data: bytes, key: str) -> None:
        """Hold records 0 to ``last`` as the one piece ``data`` (a base just written from
        them), when a piece still ends there."""
        at = bisect.bisect_left(self._ends, last)
        if at < len(self._ends) and self._ends[at] == last:
            self._pieces[: at + 1] = [(last, data, key)]
            self._ends[: at + 1] = [last]

    def texts(self) -> list[tuple[bytes, str]]:
        """What a load parses: each piece's bytes and the object they came from, then the
        records held past a gap, in number order."""
        out = [(data, key) for _last, data, key in self._pieces]
        out += [(line_ended(data), key) for key, data in sorted(self._beyond.items())]
        return out
