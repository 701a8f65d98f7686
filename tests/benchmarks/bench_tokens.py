"""Benchmark the token estimators on the Claude Code corpus: accuracy and cost.

    python tests/benchmarks/bench_tokens.py [CORPUS_DIR] [--loso] [--list-misses]

Not a test (pytest collects ``test_*.py`` only) and nothing here asserts: it prints figures.

Every main-thread transcript (``claude-code_*/**/*.jsonl``; a sub-agent file is its own thread)
is replayed call by call with the calibration state starting COLD for each file. Each call is
estimated before its usage is observed, as in a live loop. The error is judged on the estimated
part: ``estimated part - real growth``, real growth = input side(call) - usage total(anchor).
Calls without an anchor or across a compaction cannot be measured and are left out.

``--loso`` also runs the default with its base weights refitted leave-one-session-out (the
session and its sub-agents left out of the fit): the shipped priors were fitted on this corpus,
so that row is the out-of-sample figure.

Cost is CPU time (``time.process_time``), best of 3, per MB of JSONL, next to the cost of just
loading the transcripts in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's package, even when run from elsewhere

from pipeline import Message, Usage, load_transcript  # noqa: E402
from pipeline.tokens import (  # noqa: E402
    TokenTracker,
    find_anchor,
    rough_tokens_for_messages,
)
from pipeline.tokens.anchor import compaction_restart  # noqa: E402
from pipeline.tokens.calibrated import CalibratedEstimator  # noqa: E402
from pipeline.tokens.features import content_vector, is_wire_visible  # noqa: E402
from pipeline.tokens.priors import (  # noqa: E402
    CLASS_INDEX,
    FEATURES,
    PRIOR_WEIGHTS,
    model_family,
)
from pipeline.tokens.stats import BIG_GROWTH, nearest_rank  # noqa: E402
from pipeline.transcript.replay import Call, find_calls  # noqa: E402

DEFAULT_CORPUS = Path(os.environ.get("SLUICEGATE_CORPUS", REPO.parent / "shared" / "corpus"))


@dataclass
class Session:
    path: Path
    group: str
    """The main session a file belongs to (a sub-agent file belongs to its parent's)."""
    messages: list[Message]
    calls: list[Call]
    size: int


@dataclass
class Measured:
    """(estimated part, real growth) per measurable call, with where it came from."""

    pairs: list[tuple[int, int]] = field(default_factory=list)
    where: list[tuple[str, int, str]] = field(default_factory=list)
    cpu: float = 0.0
    calls: int = 0


def session_group(path: Path) -> str:
    parts = path.parts
    if "subagents" in parts:
        return parts[parts.index("subagents") - 1]
    return path.stem


def load_sessions(corpus: Path) -> tuple[list[Session], float]:
    """The sessions, and the CPU seconds loading them took."""
    t0 = time.process_time()
    sessions = []
    for path in sorted(corpus.glob("claude-code_*/**/*.jsonl")):
        messages = load_transcript(path).messages
        sessions.append(
            Session(path, session_group(path), messages, find_calls(messages), path.stat().st_size)
        )
    return sessions, time.process_time() - t0


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------

Factory = Callable[[Session], TokenTracker]


def replay(sessions: Sequence[Session], make: Factory) -> Measured:
    """Every call of every session: estimate, then observe; a fresh tracker per session."""
    out = Measured()
    for s in sessions:
        tracker = make(s)
        for call in s.calls:
            if call.usage is None:
                continue
            before = s.messages[: call.index]
            t0 = time.process_time()
            tracker.estimate(before, model=call.model)  # what a loop asks before the call
            obs = tracker.observe(before, call.usage, model=call.model)
            out.cpu += time.process_time() - t0
            out.calls += 1
            if obs.real_growth is not None:
                out.pairs.append((obs.estimated_part, obs.real_growth))
                out.where.append((s.path.name[:8], call.number, obs.family))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    return nearest_rank(sorted(values), q) if values else float("nan")


def figures(m: Measured) -> dict[str, float]:
    big = [(p - r) / r for p, r in m.pairs if r >= BIG_GROWTH]
    tok = [abs(p - r) for p, r in m.pairs]
    return {
        "n": len(m.pairs),
        "n_big": len(big),
        "signed": statistics.median(big),
        "abs": statistics.median(abs(e) for e in big),
        "p95": quantile([abs(e) for e in big], 0.95),
        "under": sum(e < -0.10 for e in big),
        "over25": sum(e > 0.25 for e in big),
        "tok_med": statistics.median(tok),
        "tok_p95": quantile(tok, 0.95),
    }


def print_table(results: dict[str, Measured]) -> None:
    print(
        f"\n## Error on the estimated part (relative: calls whose real growth >= {BIG_GROWTH:,})\n"
    )
    print(
        "| estimator | n (growth >= 2k) | median signed | median abs | p95 abs | under >10 % "
        "| over >25 % | all calls n | all: median abs (tok) | all: p95 abs (tok) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in results.items():
        f = figures(m)
        nb = f["n_big"]
        print(
            f"| {name} | {nb:.0f} | {f['signed']:+.2%} | {f['abs']:.2%} | {f['p95']:.1%} "
            f"| {f['under']:.0f} ({f['under'] / nb:.1%}) | {f['over25'] / nb:.1%} | {f['n']:.0f} "
            f"| {f['tok_med']:.0f} | {f['tok_p95']:.0f} |"
        )


def print_families(default: Measured, reference: Measured) -> None:
    print("\n## Per model family (growth >= 2k): default vs reference\n")
    print(
        "| family | n | default median abs | default under >10 % | reference median abs "
        "| reference under >10 % |"
    )
    print("|---|---|---|---|---|---|")
    fams = sorted({w[2] for w in default.where})
    for fam in fams:
        sub = {}
        for name, m in (("default", default), ("reference", reference)):
            sub[name] = Measured([p for p, w in zip(m.pairs, m.where, strict=True) if w[2] == fam])
        if not any(r >= BIG_GROWTH for _, r in sub["default"].pairs):
            continue
        d, r = figures(sub["default"]), figures(sub["reference"])
        print(
            f"| {fam} | {d['n_big']:.0f} | {d['abs']:.1%} | {d['under'] / d['n_big']:.1%} "
            f"| {r['abs']:.1%} | {r['under'] / r['n_big']:.1%} |"
        )


# ---------------------------------------------------------------------------------------------
# Leave-one-session-out priors (a Huber IRLS fit of the base weights)
# ---------------------------------------------------------------------------------------------


def feature_rows(sessions: Sequence[Session]) -> dict[str, list[tuple[list[float], float]]]:
    """Per session group: (features of what a call added since its anchor, usage delta)."""
    weights = tuple(PRIOR_WEIGHTS[f] for f in FEATURES)
    media, call_f = CLASS_INDEX["media"], FEATURES.index("call")
    rows: dict[str, list[tuple[list[float], float]]] = defaultdict(list)
    for s in sessions:
        for call in s.calls:
            before = s.messages[: call.index]
            anchor = find_anchor(before)
            if anchor is None or call.usage is None:
                continue
            i, usage = anchor
            if compaction_restart(before, i) is not None:
                continue
            if model_family(before[i].model) != model_family(call.model):
                continue
            x = [0.0] * len(FEATURES)
            image = 0.0
            for m in before[i:]:
                if is_wire_visible(m):
                    vec = content_vector(m, weights)
                    image += vec.tokens[media]
                    x = [a + b for a, b in zip(x, vec.features, strict=True)]
            x[call_f] = 1.0
            rows[s.group].append((x, call.usage.input_side - usage.input_side - image))
    return rows


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-12:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(m[r][r]) >= 1e-12:
            x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def fit_weights(
    rows: Sequence[tuple[list[float], float]], start: Sequence[float], iterations: int
) -> list[float]:
    """Huber (k = 1.345, MAD scale) iteratively reweighted least squares of y ~ x . w."""
    d = len(FEATURES)
    theta = list(start)
    for _ in range(iterations):
        resid = [y - sum(t * v for t, v in zip(theta, x, strict=True)) for x, y in rows]
        scale = 1.4826 * statistics.median(abs(r) for r in resid) + 1e-9
        w = [min(1.0, 1.345 * scale / abs(r)) if r else 1.0 for r in resid]
        ata = [[0.0] * d for _ in range(d)]
        aty = [0.0] * d
        for (x, y), wi in zip(rows, w, strict=True):
            for i in range(d):
                if x[i]:
                    aty[i] += wi * x[i] * y
                    for j in range(d):
                        ata[i][j] += wi * x[i] * x[j]
        for i in range(d):
            ata[i][i] += 1e-6 * (1.0 + ata[i][i])
        theta = _solve(ata, aty)
    return theta


def loso_weights(sessions: Sequence[Session]) -> dict[str, dict[str, float]]:
    rows = feature_rows(sessions)
    start = [PRIOR_WEIGHTS[f] for f in FEATURES]
    out = {}
    for group in rows:
        rest = [r for g, rs in rows.items() if g != group for r in rs]
        out[group] = dict(zip(FEATURES, fit_weights(rest, start, 12), strict=True))
    return out


# ---------------------------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------------------------


def best_of(n: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def ten_mb_session() -> list[Message]:
    """~10 MB in 40 tool results of build output, one response with usage before them."""
    log = "gcc -O2 -Wall -c src/parser.c -o build/parser.o\nsrc/parser.c:42:7: warning: x\n"
    out: list[Message] = [Message.user("build it")]
    for i in range(40):
        call = {"type": "tool_use", "id": f"t{i}", "name": "Bash", "input": {"command": "make"}}
        usage = Usage(input_tokens=10, output_tokens=20) if i == 0 else None
        out.append(Message.assistant([call], message_id=f"m{i}", usage=usage, model="claude-x"))
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": log * 3_300}
        out.append(Message.user([result]))
    return out


def print_cost(sessions: Sequence[Session], load_cpu: float, loop: Measured) -> None:
    mb = sum(s.size for s in sessions) / 1e6

    def default_pass() -> None:
        for s in sessions:  # cold: a fresh tracker vectorises every message once
            TokenTracker().tokens_for_messages(s.messages)

    def reference_pass() -> None:
        for s in sessions:
            rough_tokens_for_messages(s.messages)

    t_default, t_ref = best_of(3, default_pass), best_of(3, reference_pass)
    big = ten_mb_session()
    big_mb = sum(len(str(m.content)) for m in big) / 1e6
    t_big = best_of(3, lambda: TokenTracker().estimate(big))
    t_big_ref = best_of(3, lambda: TokenTracker("reference").estimate(big))
    print("\n## Cost (CPU time, best of 3)\n")
    print("| what | default | reference |\n|---|---|---|")
    print(
        f"| load the {len(sessions)} transcripts ({mb:.1f} MB JSONL), once | "
        f"{load_cpu * 1000:.0f} ms = {load_cpu / mb * 1000:.1f} ms/MB | (same) |"
    )
    print(
        f"| price every message once, cold | {t_default * 1000:.0f} ms = "
        f"**{t_default / mb * 1000:.1f} ms/MB** ({t_default / load_cpu:.0%} of loading) | "
        f"{t_ref * 1000:.0f} ms = {t_ref / mb * 1000:.1f} ms/MB ({t_ref / load_cpu:.0%}) |"
    )
    print(
        f"| estimate a {big_mb:.1f} MB session, cold | {t_big * 1000:.1f} ms = "
        f"{t_big / big_mb * 1000:.2f} ms/MB | {t_big_ref * 1000:.1f} ms = "
        f"{t_big_ref / big_mb * 1000:.2f} ms/MB |"
    )
    print(
        f"| replay loop: estimate + observe per call | "
        f"{loop.cpu / max(1, loop.calls) * 1e6:.0f} µs ({loop.calls} calls) | |"
    )


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("corpus", nargs="?", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--loso", action="store_true", help="also leave-one-session-out priors")
    parser.add_argument("--list-misses", action="store_true", help="list the default's misses")
    args = parser.parse_args()
    if not args.corpus.is_dir():
        sys.exit(f"no corpus at {args.corpus}")
    wall = time.perf_counter()
    sessions, load_cpu = load_sessions(args.corpus)
    print(f"# Token estimators on {args.corpus}")
    print(
        f"- {len(sessions)} transcripts, {sum(len(s.calls) for s in sessions):,} calls; "
        "calibration state cold for each session, each call estimated before it is observed"
    )
    variants: dict[str, Factory] = {
        "reference (docs/behaviour.md §4, len/4)": lambda s: TokenTracker("reference"),
        "default (calibrated, shipped priors)": lambda s: TokenTracker(),
    }
    if args.loso:
        loso = loso_weights(sessions)
        variants["default, leave-one-session-out priors"] = lambda s: TokenTracker(
            estimator=CalibratedEstimator(weights=loso.get(s.group, PRIOR_WEIGHTS))
        )
    results = {name: replay(sessions, make) for name, make in variants.items()}
    names = list(results)
    reference, default = results[names[0]], results[names[1]]
    print(f"- measured calls: {len(default.pairs):,} (an anchor, no compaction since it)")
    print_table(results)
    print_families(default, reference)
    if args.list_misses:
        print("\n## Default: growth >= 2k, under-counted by more than 10 %\n")
        misses = [
            (p / r - 1, w, p, r)
            for (p, r), w in zip(default.pairs, default.where, strict=True)
            if r >= BIG_GROWTH and p < 0.9 * r
        ]
        for err, (file, n, fam), p, r in sorted(misses):
            print(f"- {file} call {n} [{fam}]: real {r:,}, estimated {p:,} ({err:+.0%})")
    print_cost(sessions, load_cpu, default)
    print(f"\n(total {time.perf_counter() - wall:.1f} s wall, {time.process_time():.1f} s CPU)")


if __name__ == "__main__":
    main()
