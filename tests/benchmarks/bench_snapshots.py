"""What record snapshots cost in bytes: one conversation served call by call through a worker
(``WireSession``, the proxy's per-call work without HTTP, its settle after each response) on an
in-memory object store that counts what is written, beside the bytes of the requests the client
sent. Every other result is over the per-tool cap and persisted.

    python tests/benchmarks/bench_snapshots.py [--calls 1000]

Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import anyio  # noqa: E402
from obstore.store import MemoryStore  # noqa: E402

from tests.objectstore_support import Wrapped  # noqa: E402
from tests.test_object_snapshots import growing, open_worker, serve  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000)
    calls = parser.parse_args().calls
    written = {"records": [0, 0], "snapshots": [0, 0], "results": [0, 0], "deletes": [0, 0]}

    def put(path: str, file: bytes, **_kwargs: Any) -> None:
        kind = (
            "snapshots"
            if "-snapshots/" in path
            else "records"
            if "/records/" in path
            else "results"
        )
        written[kind][0] += len(file)
        written[kind][1] += 1

    def delete(paths: Any) -> None:
        written["deletes"][1] += 1

    store = Wrapped(MemoryStore(), before={"put": put, "delete": delete})
    params = growing(calls + 1)
    sent = 0

    async def run() -> None:
        nonlocal sent
        with tempfile.TemporaryDirectory() as root:
            worker = await open_worker(store, Path(root))
            for n in range(calls):
                await serve(worker, params[: 2 * n + 1], n)
                sent += len(json.dumps(params[: 2 * n + 1]))

    anyio.run(run)
    (rec, nrec), (snap, nsnap) = written["records"], written["snapshots"]
    print(f"{calls:,} calls")
    print(f"  records   {rec / 1e6:8.2f} MB in {nrec:,} objects")
    print(
        f"  snapshots {snap / 1e6:8.2f} MB in {nsnap:,} objects: {snap / calls / 1e3:.1f} KB a call"
    )
    print(f"  batch deletes of old snapshots: {written['deletes'][1]}")
    print(f"  the client's requests: {sent / calls / 1e6:.2f} MB a call on average")
    print(f"  snapshots / requests: {100 * snap / sent:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
