"""What the proxy and ``wrap`` add to a request: each against a direct call to the same scripted
server, side by side, at 10, 100 and 1,000 messages.

    python tests/benchmarks/bench_proxy.py [--sizes 10,100,1000] [--calls 30]

Not a test: it prints figures. Each call sends the conversation grown by one round (a tool
call and its ~2K-char result), as a client loop does; wall time per call from the client's side
(the SDK, the HTTP hops, the pipeline), mean and median over ``--calls`` calls per size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import anthropic  # noqa: E402

from pipeline import Pipeline  # noqa: E402
from pipeline.testing import Reply, ScriptedMessagesServer  # noqa: E402
from stages import default_stages, wrap  # noqa: E402
from tests.wire_support import proxy  # noqa: E402


def history(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
    k = 0
    while len(out) < n - 1:
        tid = f"toolu_{k:05d}"
        out.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tid, "name": "x", "input": {}}],
            }
        )
        out.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tid, "content": "y" * 2_000}],
            }
        )
        k += 1
    return out


def timed(client: anthropic.Anthropic, base: list[dict[str, Any]], calls: int) -> list[float]:
    messages = list(base)
    times = []
    for k in range(calls):
        start = time.perf_counter()
        client.messages.create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]
        times.append((time.perf_counter() - start) * 1000)
        tid = f"toolu_next_{k}"
        messages += [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tid, "name": "x", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tid, "content": "z" * 2_000}],
            },
        ]
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    heads = ("messages", "direct ms", "proxy ms", "wrap ms", "proxy/direct", "wrap/direct")
    print(" ".join(h.rjust(w) for h, w in zip(heads, (8, 18, 18, 18, 13, 12), strict=True)))
    with ScriptedMessagesServer(lambda _b: Reply([{"type": "text", "text": "ok"}])) as server:
        for n in (int(x) for x in args.sizes.split(",")):
            base = history(n)
            with tempfile.TemporaryDirectory() as root:
                direct = timed(
                    anthropic.Anthropic(base_url=server.base_url, api_key="k"), base, args.calls
                )
                with proxy(
                    server.base_url, Path(root) / "p", lambda: Pipeline(default_stages())
                ) as url:
                    via_proxy = timed(
                        anthropic.Anthropic(base_url=url, api_key="k"), base, args.calls
                    )
                wrapped = wrap(
                    anthropic.Anthropic(base_url=server.base_url, api_key="k"),
                    root=Path(root) / "w",
                )
                via_wrap = timed(wrapped, base, args.calls)

            def fmt(t: list[float]) -> str:
                return f"{statistics.mean(t):7.2f} / {statistics.median(t):6.2f}"

            ratio_p = statistics.median(via_proxy) / statistics.median(direct)
            ratio_w = statistics.median(via_wrap) / statistics.median(direct)
            cells = (fmt(direct), fmt(via_proxy), fmt(via_wrap))
            print(f"{n:>8} " + " ".join(c.rjust(18) for c in cells), end=" ")
            print(f"{ratio_p:>12.2f}x {ratio_w:>11.2f}x")
    print("(mean / median ms per call, wall, from the client; ratios of medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
