"""Compare pipelines over the whole corpus under the prefix-cache cost model.

    python tests/benchmarks/bench_compare.py [CORPUS_DIR] [--pipelines none,truncate,...]

Replays every Claude Code session of the corpus (main threads and sub-agent files) under each
pipeline and prints the totals: tokens sent, cache reads / writes / uncached, prefix breaks, the
peak request, calls over the window and the cost. The figures in the README come from here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

from pipeline import SessionContext, ToolPolicies, load_transcript
from pipeline._cli.compare import RunStats, compare_pipelines, format_table
from stages.registry import COMPARISON_POINTS, comparison_pipeline

DEFAULT_CORPUS = Path(__file__).resolve().parents[3] / "shared" / "corpus"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--pipelines", default=",".join(COMPARISON_POINTS))
    args = parser.parse_args()
    files = sorted(args.corpus.glob("claude-code_*/**/*.jsonl"))
    if not files:
        print(f"no corpus at {args.corpus}", file=sys.stderr)
        return 1
    names = [n for n in args.pipelines.split(",") if n]
    totals = {n: RunStats(n) for n in names}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            transcript = load_transcript(path)
            pipelines = {n: comparison_pipeline(n) for n in names}

            def context(name: str, path: Path = path) -> SessionContext:
                return SessionContext(
                    "s", Path(tmp) / path.stem / name, tool_policies=ToolPolicies.claude_code()
                )

            runs = anyio.run(
                lambda: compare_pipelines(transcript.messages, pipelines, context)  # noqa: B023
            )
            for run in runs:
                t = totals[run.name]
                t.calls += run.calls
                t.tokens_sent += run.tokens_sent
                t.cache_read += run.cache_read
                t.cache_write += run.cache_write
                t.uncached += run.uncached
                t.prefix_breaks += run.prefix_breaks
                t.peak_tokens = max(t.peak_tokens, run.peak_tokens)
                t.over_window += run.over_window
                t.cost_usd += run.cost_usd
    print(
        f"{len(files)} sessions, {totals[names[0]].calls} calls, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(format_table(list(totals.values())))
    base = totals.get("none")
    if base is not None and base.cost_usd:
        for t in totals.values():
            print(
                f"{t.name}: cost {t.cost_usd / base.cost_usd:.2f}x of no management, "
                f"tokens sent {t.tokens_sent / base.tokens_sent:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
