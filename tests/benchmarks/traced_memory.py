"""Where a replay's memory goes: traced (tracemalloc) at the replay's last call, by what holds it.

    python tests/benchmarks/traced_memory.py SESSION.jsonl

Prints one JSON object (bytes): ``loading`` (what loading the transcript left allocated), and
of what the replay added since, by the module that asked for each allocation: ``request`` (the
request cache's params and pairing index: what the call sends), ``rewritten`` (records the
stages send rewritten: cleared results, previews), ``state`` (the incremental components: the
stages' caches and watches, the token estimators, the ledger) and ``replay`` (the replay's own
bookkeeping: its history, its calls, responses with lowered usage) and ``read back`` (outputs
left in the file at loading, read while a request can carry them). Replayed as the ``replay``
command replays (long outputs deferred, put back once no request carries them). An
allocation is charged to
the innermost frame in one of those modules, past the helpers every one of them uses (records,
kept lists, dataclasses). Also ``records``: how many the transcript holds. Not a test;
``bench_long.py`` runs it in a child process.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import anyio  # noqa: E402

from pipeline import Pipeline, SessionContext, ToolPolicies, load_transcript  # noqa: E402
from pipeline.testing import QuietLogger  # noqa: E402
from pipeline.transcript.deferred import DEFER_AT  # noqa: E402
from pipeline.transcript.replay import find_calls, replay_messages  # noqa: E402
from stages import default_stages  # noqa: E402

_HELPERS = ("pipeline/messages.py", "pipeline/kept_list.py", "dataclasses.py", "<string>")
"""Allocations made here are charged to the module that called them."""
_OWNERS = (
    ("pipeline/wire/deferred.py", "read back"),  # before the rest of wire/
    ("pipeline/wire", "request"),  # wire.py and wire_cache.py
    ("pipeline/wire/pairing.py", "request"),
    ("pipeline/wire/caching.py", "request"),
    ("stages/_shared/results.py", "rewritten"),
    ("pipeline/gate.py", "rewritten"),
    ("pipeline/transcript/replay.py", "replay"),
    ("json/decoder.py", "read back"),  # only the outputs read back parse JSON after loading
    ("stages/", "state"),
    ("pipeline/", "state"),
)


def _owner(traceback: tracemalloc.Traceback) -> str:
    for frame in reversed(traceback):  # innermost first
        name = frame.filename.replace("\\", "/")
        if any(h in name for h in _HELPERS):
            continue
        for prefix, owner in _OWNERS:
            if f"/{prefix}" in name or name.startswith(prefix):
                return owner
    return "other"


async def _replay(path: Path, root: str) -> dict[str, int]:
    tracemalloc.start(3)  # deep enough to pass the helpers; deeper costs minutes
    transcript = load_transcript(path, defer_texts=DEFER_AT)  # as the replay command
    gc.collect()
    loaded = tracemalloc.take_snapshot()
    at = max(1, len(find_calls(transcript.messages)) - 10)
    ctx = SessionContext(
        "traced", root, tool_policies=ToolPolicies.claude_code(), logger=QuietLogger(keep=False)
    )
    sizes: dict[str, int] = {}
    n = 0
    async for _ in replay_messages(
        transcript.messages, Pipeline(default_stages()), ctx, shared=True, release=True
    ):
        n += 1
        if n == at:  # the request of this call still held, as a caller holds it
            gc.collect()
            later = tracemalloc.take_snapshot()
            grown: Counter[str] = Counter()
            for stat in later.compare_to(loaded, "traceback"):
                grown[_owner(stat.traceback)] += stat.size_diff
            sizes = dict(grown)
            sizes["loading"] = sum(s.size for s in loaded.statistics("filename"))
    tracemalloc.stop()
    sizes["records"] = len(transcript.messages)
    return sizes


def main() -> int:
    with tempfile.TemporaryDirectory() as root:
        sizes = anyio.run(_replay, Path(sys.argv[1]), root)
    print(json.dumps(sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
