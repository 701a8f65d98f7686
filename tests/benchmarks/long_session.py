"""A long generated Claude Code session (JSONL), for the long-session benchmarks.

The shape of a real long agent session: one prompt, then per call one assistant record with 1-3
tool_use blocks (60/20/20 %) among Bash, Grep, WebFetch and Read, and one user record per
tool_result. Result bodies are the id and random 89-character lines, at sizes from 100 to 45,000
characters; each response's usage grows with the session (cache reads 20,000 + 50 per call). A
final text response closes it. Deterministic for a seed.

    python tests/benchmarks/long_session.py OUT.jsonl --calls 4000
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline import Message, TranscriptWriter, Usage  # noqa: E402

SIZES = (100, 300, 800, 2_000, 8_000, 45_000)
SIZE_WEIGHTS = (30, 25, 20, 12, 9, 4)
TOOLS = ("Bash", "Grep", "WebFetch", "Read")
_ALPHABET = string.ascii_letters + string.digits + " _-./"


def _body(rng: random.Random, tid: str, size: int) -> str:
    lines = [tid]
    n = len(tid)
    while n < size:
        line = "".join(rng.choices(_ALPHABET, k=89))
        lines.append(line)
        n += 90
    return "\n".join(lines)[:size]


def generate(calls: int, seed: int = 7) -> list[Message]:
    """The session's records: ``calls`` API calls (the last one a plain text answer)."""
    rng = random.Random(seed)
    t0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
    clock = [t0]

    def stamp() -> str:
        clock[0] += timedelta(milliseconds=rng.randint(200, 4_000))
        return clock[0].isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def uid(prefix: str, k: int) -> str:
        return f"{prefix}_{k:06d}_" + "".join(rng.choices(string.ascii_letters, k=12))

    out = [Message.user("Work through the failing jobs and fix them.", timestamp=stamp())]
    for i in range(calls - 1):
        width = rng.choices((1, 2, 3), weights=(60, 20, 20))[0]
        ids = [uid("toolu", i * 3 + k) for k in range(width)]
        uses = [
            {
                "type": "tool_use",
                "id": tid,
                "name": rng.choice(TOOLS),
                "input": {"command": f"step {i}.{k}"},
            }
            for k, tid in enumerate(ids)
        ]
        usage = Usage(
            input_tokens=3,
            cache_creation_input_tokens=500,
            cache_read_input_tokens=20_000 + 50 * i,
            output_tokens=40 * width,
        )
        out.append(
            Message.assistant(
                uses,
                message_id=uid("msg", i),
                usage=usage,
                model="claude-opus-4-6",
                stop_reason="tool_use",
                timestamp=stamp(),
            )
        )
        for tid in ids:
            size = rng.choices(SIZES, weights=SIZE_WEIGHTS)[0]
            block = {"type": "tool_result", "tool_use_id": tid, "content": _body(rng, tid, size)}
            out.append(Message.user([block], timestamp=stamp()))
    done = Usage(
        input_tokens=3,
        cache_creation_input_tokens=500,
        cache_read_input_tokens=20_000 + 50 * calls,
        output_tokens=20,
    )
    out.append(
        Message.assistant(
            [{"type": "text", "text": "All jobs pass now."}],
            message_id=uid("msg", calls),
            usage=done,
            model="claude-opus-4-6",
            stop_reason="end_turn",
            timestamp=stamp(),
        )
    )
    return out


def write(path: Path, calls: int, seed: int = 7) -> Path:
    """Write the session to ``path`` (replaced) and return it."""
    path.unlink(missing_ok=True)
    TranscriptWriter(path, f"long-{calls}").append_messages(generate(calls, seed))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--calls", type=int, default=4_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    write(args.out, args.calls, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
