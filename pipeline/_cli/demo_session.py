"""A generated Claude Code session for ``python -m pipeline demo``: no API key, network or corpus.

The session is built deterministically from a seed and has the shapes that exercise the budget:

- call 0: the prompt; the model asks for ten CI shard logs in parallel (an MCP tool, ~40K chars
  each, ~400K together: every result passes the per-tool gate, the message as a whole does not);
- call 1: a ``Read`` of a ~56K-char file (never persisted: the model would read the file back
  with the same tool) and a small ``Grep``;
- call 2: one ``Bash`` run printing ~80K chars (over Bash's declared 30K: the per-tool gate);
- call 3: an ``Edit`` and a short ``Bash`` run; call 4: the final answer.

Records are streamed the Claude Code way: one assistant record per content block sharing the
response's ``message.id``, each tool_result in its own user record, progress records in between.
Each response carries ``usage`` as Claude Code (which applies the same budget) would have seen it.
Every tool output contains :data:`OUTPUT_MARKER`, so tests can prove no output text leaks into
spans or logs.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pipeline.messages import Block, Content, Message, Usage
from pipeline.policies import MAX_TOOL_RESULTS_PER_MESSAGE_CHARS, ToolPolicies
from pipeline.transcript.read import TranscriptWriter

__all__ = ["DEFAULT_SEED", "OUTPUT_MARKER", "DemoSession", "generate_session", "write_session"]

DEFAULT_SEED = 7731
OUTPUT_MARKER = "ledgerline-ci-7731"
"""Appears in every generated tool output (and nowhere else)."""

MODEL = "claude-sonnet-4-5-20250929"
_START = datetime(2025, 6, 2, 3, 14, 7, tzinfo=UTC)
_REPO = "/home/dev/ledgerline"
# Tokens of the system prompt and tool definitions Claude Code sends before any message.
_SYSTEM_TOKENS = 14_210
# Claude 4.x tokenises code and logs at ~2.8 chars/token, prose nearer 3.8.
_CHARS_PER_TOKEN_TOOL = 2.8
_CHARS_PER_TOKEN_TEXT = 3.8
# What a persisted result costs on the wire: the 2KB preview plus the wrapper text.
_REPLACEMENT_CHARS = 2_300
_B62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, slots=True)
class DemoSession:
    """A generated session: its id and its records, in transcript order."""

    session_id: str
    messages: list[Message]


@dataclass(slots=True)
class _ToolCall:
    name: str
    input: dict[str, Any]
    output: Content


@dataclass(slots=True)
class _Turn:
    text: str
    calls: list[_ToolCall] = field(default_factory=list)
    thinking: str | None = None


class _Builder:
    """Deterministic ids, timestamps and record construction for one session."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.clock = _START
        self.messages: list[Message] = []

    def _id(self, prefix: str) -> str:
        return prefix + "".join(self.rng.choice(_B62) for _ in range(22))

    def _uuid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def _tick(self, millis: int) -> str:
        self.clock += timedelta(milliseconds=millis)
        return self.clock.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def add(self, type_: Any, content: Content = "", millis: int = 40, **kw: Any) -> Message:
        m = Message(
            type=type_, content=content, uuid=self._uuid(), timestamp=self._tick(millis), **kw
        )
        self.messages.append(m)
        return m

    def response(self, turn: _Turn, usage: Usage, last: bool) -> list[str]:
        """One streamed response: a record per block, all sharing one message id."""
        message_id = self._id("msg_01")
        blocks: list[Block] = []
        if turn.thinking is not None:
            signature = "".join(self.rng.choice(_B62) for _ in range(344))
            blocks.append({"type": "thinking", "thinking": turn.thinking, "signature": signature})
        blocks.append({"type": "text", "text": turn.text})
        ids = [self._id("toolu_01") for _ in turn.calls]
        blocks += [
            {"type": "tool_use", "id": i, "name": c.name, "input": c.input}
            for i, c in zip(ids, turn.calls, strict=True)
        ]
        for n, block in enumerate(blocks):
            final = n == len(blocks) - 1
            stop = ("end_turn" if last else "tool_use") if final else None
            # streaming snapshots: the input side is fixed, output tokens grow
            snapshot = Usage(
                input_tokens=usage.input_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens,
                cache_read_input_tokens=usage.cache_read_input_tokens,
                output_tokens=usage.output_tokens if final else 1 + n,
            )
            self.add(
                "assistant",
                [block],
                millis=600 if n == 0 else 350,
                message_id=message_id,
                model=MODEL,
                usage=snapshot,
                stop_reason=stop,
            )
        return ids

    def results(self, ids: list[str], calls: list[_ToolCall]) -> None:
        """Progress records while the tools run, then one user record per tool_result."""
        for _ in calls:
            self.add("progress", millis=15)
        for tool_use_id, call in zip(ids, calls, strict=True):
            self.add("progress", millis=900)
            block = {"type": "tool_result", "tool_use_id": tool_use_id, "content": call.output}
            self.add("user", [{**block, "is_error": False}], millis=20)


# ---------------------------------------------------------------------------------------------
# Tool outputs
# ---------------------------------------------------------------------------------------------


def _lines_until(size: int, lines: Iterator[str]) -> str:
    out: list[str] = []
    total = 0
    for line in lines:
        if total + len(line) + 1 > size:
            break
        out.append(line)
        total += len(line) + 1
    return "\n".join(out) + "\n"


def _shard_log(rng: random.Random, shard: int, size: int, failing: bool) -> str:
    def lines() -> Iterator[str]:
        yield f"=== {OUTPUT_MARKER} shard {shard:02d}/10 :: pytest -n 4 tests/ ==="
        t = 0.0
        case = 0
        while True:
            t += rng.uniform(0.01, 0.4)
            case += 1
            module = rng.choice(["rollup", "ledger", "fx", "accounts", "export", "audit"])
            status = "PASSED"
            if failing and case % 97 == 0:
                status = "FAILED"
            yield (
                f"[{t:9.3f}s] {OUTPUT_MARKER} shard-{shard:02d} "
                f"tests/{module}/test_{module}_{case % 53:02d}.py::test_case_{case:04d} {status}"
            )
            if status == "FAILED":
                total = rng.randint(10**5, 10**6)
                yield f"    E   AssertionError: rollup total {total} != expected"
                yield "    E   (month boundary: 2025-05-31T23:59:59Z counted twice)"

    return _lines_until(size, lines())


def _read_output(rng: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        n = 0
        yield f"{1:>6}→# {OUTPUT_MARKER}: ledgerline.rollup: monthly and quarterly ledger rollups"
        n = 1
        while True:
            n += 1
            kind = rng.random()
            if kind < 0.1:
                code = f"def rollup_{rng.choice(['month', 'quarter', 'account'])}_{n}(entries):"
            elif kind < 0.2:
                code = ""
            else:
                var = rng.choice(["total", "bucket", "cutoff", "entry", "ts"])
                code = f"    {var} = _normalise({var}, tz=UTC)  # {OUTPUT_MARKER} line {n}"
            yield f"{n:>6}→{code}"

    return _lines_until(size, lines())


def _grep_output(rng: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        while True:
            line = rng.randint(1, 1400)
            yield f"src/ledgerline/rollup.py:{line}:def rollup_month_{line}(e):  # {OUTPUT_MARKER}"

    return _lines_until(size, lines())


def _pytest_verbose(rng: random.Random, size: int) -> str:
    def lines() -> Iterator[str]:
        yield f"============ test session starts ({OUTPUT_MARKER}) ============"
        n = 0
        while True:
            n += 1
            yield (
                f"tests/rollup/test_month.py::test_boundary[{n:04d}-case] "
                f"PASSED  [{rng.randint(0, 99):3d}%]  {OUTPUT_MARKER}"
            )
            if n % 40 == 0:
                yield "    rollup.py:212: cutoff = month_end.replace(hour=23, minute=59, second=59)"

    return _lines_until(size, lines())


def _session_turns(rng: random.Random) -> tuple[str, list[_Turn]]:
    prompt = (
        "The nightly CI run of ledgerline failed on several shards. Pull the job logs for all "
        "ten shards, find the failing tests and fix the rollup bug."
    )
    failing = {3, 7}
    logs = [
        _ToolCall(
            "mcp__ci__get_job_log",
            {"run_id": 7731, "shard": s},
            [
                {
                    "type": "text",
                    "text": _shard_log(rng, s, rng.randint(36_000, 44_000), s in failing),
                }
            ],
        )
        for s in range(1, 11)
    ]
    turns = [
        _Turn(
            "I'll pull all ten shard logs in parallel.",
            logs,
            thinking="Ten shards; fetching every log at once is fastest.",
        ),
        _Turn(
            "Shards 3 and 7 fail in the monthly rollup. Reading the module and its entry points.",
            [
                _ToolCall(
                    "Read",
                    {"file_path": f"{_REPO}/src/ledgerline/rollup.py"},
                    _read_output(rng, 56_000),
                ),
                _ToolCall(
                    "Grep",
                    {"pattern": "def rollup_", "path": "src", "output_mode": "content"},
                    _grep_output(rng, 6_000),
                ),
            ],
        ),
        _Turn(
            "Running the rollup tests verbosely to see the boundary cases.",
            [
                _ToolCall(
                    "Bash",
                    {
                        "command": "pytest tests/rollup -vv 2>&1",
                        "description": "Run rollup tests verbosely",
                    },
                    _pytest_verbose(rng, 80_000),
                )
            ],
        ),
        _Turn(
            "The month-end cutoff is inclusive on both sides. Fixing it and re-running.",
            [
                _ToolCall(
                    "Edit",
                    {
                        "file_path": f"{_REPO}/src/ledgerline/rollup.py",
                        "old_string": "cutoff = month_end.replace(hour=23, minute=59, second=59)",
                        "new_string": "cutoff = next_month_start  # half-open interval",
                    },
                    f"The file {_REPO}/src/ledgerline/rollup.py has been updated. "
                    f"({OUTPUT_MARKER})",
                ),
                _ToolCall(
                    "Bash",
                    {"command": "pytest tests/rollup -q", "description": "Re-run rollup tests"},
                    f"{OUTPUT_MARKER}\n" + "." * 1_400 + "\n1412 passed in 8.13s\n",
                ),
            ],
        ),
        _Turn(
            "Fixed: the monthly cutoff counted the last second of a month twice; it is now a "
            "half-open interval and all 1412 rollup tests pass."
        ),
    ]
    return prompt, turns


# ---------------------------------------------------------------------------------------------
# Usage as Claude Code would have seen it
# ---------------------------------------------------------------------------------------------


def _output_chars(content: Content) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(str(b.get("text", ""))) for b in content)


def _sent_sizes(calls: list[_ToolCall]) -> list[int]:
    """Chars of each result as Claude Code's own budget would have sent them (default limits)."""
    policies = ToolPolicies.claude_code()
    sizes = [_output_chars(c.output) for c in calls]
    sent = list(sizes)
    pool: list[int] = []
    for i, c in enumerate(calls):
        threshold = policies.threshold(c.name)
        if math.isinf(threshold):
            continue
        if sizes[i] > threshold:
            sent[i] = _REPLACEMENT_CHARS
        else:
            pool.append(i)
    remaining = sum(sent[i] for i in pool)
    for i in sorted(pool, key=lambda i: sizes[i], reverse=True):
        if remaining <= MAX_TOOL_RESULTS_PER_MESSAGE_CHARS:
            break
        remaining -= sizes[i] - _REPLACEMENT_CHARS
        sent[i] = _REPLACEMENT_CHARS
    return sent


def _turn_tokens(turn: _Turn) -> int:
    """Output tokens of a response: its text, thinking and tool inputs."""
    chars = len(turn.text) + len(turn.thinking or "")
    chars += sum(len(c.name) + len(json.dumps(c.input)) for c in turn.calls)
    return 12 + round(chars / _CHARS_PER_TOKEN_TEXT)


def _usages(prompt: str, turns: list[_Turn], rng: random.Random) -> list[Usage]:
    """One usage per response: the cached prefix is read back, what is new is written."""
    context = _SYSTEM_TOKENS + round(len(prompt) / _CHARS_PER_TOKEN_TEXT)
    cached = _SYSTEM_TOKENS  # the system prompt is warm from an earlier session
    usages: list[Usage] = []
    for turn in turns:
        fresh_input = rng.randint(1, 9)
        output = _turn_tokens(turn)
        usages.append(
            Usage(
                input_tokens=fresh_input,
                cache_creation_input_tokens=context - cached - fresh_input,
                cache_read_input_tokens=cached,
                output_tokens=output,
            )
        )
        cached = context
        context += output + round(sum(_sent_sizes(turn.calls)) / _CHARS_PER_TOKEN_TOOL)
    return usages


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def generate_session(seed: int = DEFAULT_SEED) -> DemoSession:
    """Build the demo session; the same seed always gives the same records, byte for byte."""
    rng = random.Random(seed)
    session_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    prompt, turns = _session_turns(rng)
    usages = _usages(prompt, turns, rng)
    b = _Builder(rng)
    b.add("progress", millis=0)  # a SessionStart hook, as Claude Code records it
    b.add("user", prompt, millis=2_500)
    for n, (turn, usage) in enumerate(zip(turns, usages, strict=True)):
        ids = b.response(turn, usage, last=n == len(turns) - 1)
        b.results(ids, turn.calls)
    return DemoSession(session_id, b.messages)


def write_session(path: str | Path, seed: int = DEFAULT_SEED) -> DemoSession:
    """Generate the demo session and write it as a Claude Code JSONL transcript at ``path``.

    An existing file at ``path`` is replaced.
    """
    session = generate_session(seed)
    target = Path(path)
    target.unlink(missing_ok=True)
    TranscriptWriter(target, session.session_id).append_messages(session.messages)
    return session
