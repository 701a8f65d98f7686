"""Fuzz tests: hostile transcript files and hostile messages (invariant 7 of docs/behaviour.md:
bad input).

A. ``load_transcript`` on generated JSONL files that mix valid Claude Code records with
   malformed JSON (truncated records, garbage bytes, invalid UTF-8, NUL bytes, numbers past
   Python's 4,300-digit limit), valid JSON of the wrong shape (arrays, numbers, null, strings),
   records with missing fields or fields of the wrong type (content as int / dict / list of
   ints, message as a string, usage with strings / negatives / floats / bools / counts past
   ``MAX_TOKENS``, uuid as a list, unknown types...), deep nesting (up to 10,000 levels: past
   the recursion limit of ``json.loads``; records deeper than ``MAX_NESTING`` are malformed by
   contract), strings of a few MB, unicode (emoji, RTL, combining marks, lone surrogates escaped
   in JSON or made by invalid UTF-8) and bare CRs (JSON whitespace, not a line break).
   Contract, checked line by line against what each generated line is:

   - ``strict=False`` never raises for a bad line: every bad line is in ``problems`` (with its
     1-based number), no valid line is, and the valid records still load, in order (main thread
     vs sidechain as documented), with the replacement records, stage records and unknown-type
     counts they carry;
   - strict mode either loads (only when there is no bad line) or raises ``TranscriptError``
     whose message starts with ``<path>:<line>:`` for the FIRST bad line (the same line and
     reason that the lenient load reports);
   - nothing else is ever raised; a watchdog fails an example that runs for too long.

B. The default pipeline (``Pipeline(default_stages())``, a ``SessionContext`` with a real
   ``FileToolResultStore`` under a fresh temp dir, sometimes a real ``TranscriptWriter``):

   - on whatever ``load_transcript(strict=False)`` accepted from generated files: two passes
     of ``Pipeline.run`` (the second one re-applies the first one's decisions), each followed by
     ``to_api``, never raise. (Equal requests from the two passes are NOT asserted: autocompact
     may legitimately compact a still-too-large projection again; the one real inconsistency
     this found has its own test below.)
   - on ``Message`` objects built directly with hostile-but-typed content (tool_result content
     that is a list of odd blocks, blocks missing keys, tool_use ids like ``../../etc/passwd``,
     empty, 10 KB long, NUL-containing or duplicated, 300 KB-1 MB results, image blocks with
     forged headers, nested lists, junk timestamps, huge usage): either success, or a
     ``StageError`` / ``ValueError`` / ``TypeError`` that says what was wrong; never a
     ``KeyError`` / ``AttributeError`` / ``IndexError`` / ``RecursionError`` / ... escaping,
     and never a ``StageError`` that merely wraps one of those;
   - no file is ever written outside ``<root>/<session>/tool-results`` (besides the input file
     and the transcript), no temp file is left behind, and every reported persisted path lies
     in that directory.

What this file found (each now has a test at the end of the file):

- fixed in the working tree while this file was written, now plain regression tests: a JSON
  ``\\ud800`` in a persisted result crashed ``TranscriptWriter`` appends; a surrogate uuid
  crashed history snip's ``uuid5``; usage counts past 1.8e308 crashed the calibrated estimate
  (the loader now bounds them to ``MAX_TOKENS``); nesting the loader accepted crashed the
  token estimate with ``RecursionError`` (the loader now caps it at ``MAX_NESTING``); a bare
  CR split a record; a skipped line still set ``session_id`` / kept replacement records; a
  non-dict content item crashed ``rounds.safe_cuts`` / ``to_api`` with ``AttributeError``;
  microcompact forgot the tokens it freed when it re-applied its clears;
- and, fixed after: a ``Usage`` built directly with a huge count (now refused at construction)
  and content built directly past the recursion limit (now a ValueError naming the record)
  crashed ``Pipeline.run``.

Example counts (hypothesis ``max_examples``) are the ``*_EXAMPLES`` constants below.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import os
import re
import signal
import struct
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from pipeline import (
    FileToolResultStore,
    Message,
    Pipeline,
    SessionContext,
    StageError,
    TranscriptWriter,
    Usage,
    load_transcript,
    to_api,
)
from pipeline.messages import MAX_TOKENS
from pipeline.store.files import TOOL_RESULTS_SUBDIR
from pipeline.tracing import ATTR
from pipeline.transcript.read import MAX_NESTING, TranscriptError
from stages import default_stages

# ---------------------------------------------------------------------------------------------
# Budgets: examples per test (quotable) and the watchdog
# ---------------------------------------------------------------------------------------------

LOADER_EXAMPLES = 200
"""A: generated JSONL files, each loaded with strict=False and strict=True."""
PIPELINE_LOADED_EXAMPLES = 100
"""B: generated files -> load_transcript(strict=False) -> 2 x Pipeline.run -> to_api."""
PIPELINE_BUILT_EXAMPLES = 150
"""B: directly built hostile Message lists -> Pipeline.run -> to_api."""

SCALE = float(os.environ.get("SLUICEGATE_FUZZ_SCALE", "1"))
"""Multiplies every example count above (e.g. ``SLUICEGATE_FUZZ_SCALE=20`` for a long hunt)."""

WATCHDOG_SECONDS = 30.0
"""One load or one pipeline pass taking longer than this counts as a hang."""

FUZZ_SETTINGS = {
    "deadline": None,  # sizes are bounded; a real hang is caught by the watchdog instead
    "suppress_health_check": [
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
}

SID = "fuzz-session"
OTHER_SID = "other-session-☃"
SAFE_DEPTH = 200
"""Nesting this deep is fine everywhere (far from any recursion limit)."""
HOPELESS_DEPTH = 10_000
"""Nesting this deep is past json.loads' limit however the stack looks (limit + 2000 < this)."""

KNOWN_MESSAGE_TYPES = ("user", "assistant", "progress", "attachment", "system")
SPECIAL_TYPES = ("content-replacement", "stage-record")

UNICODE_SAMPLES = (
    "héllo wörld",
    "👩‍👩‍👧‍👦🙂🚀🏳️‍🌈",
    "שלום עולם مرحبا بالعالم",
    "\u202eevil.txt\u202c",
    "e\u0301\u0301\u0301 Z\u0334\u0321\u031b\u0353a\u0336l\u0337g\u0338o\u0335",
    "中文字符テスト한국어",
    "\u200b\u200c\u200d\ufeff",
    "a\u2028b\u2029c\u0085d",
    "\x00nul\x00",
    "tab\tand\x1b[31mescape\x1b[0m",
    "\U0010ffff\U0001f600",
    "<persisted-output>\nnot really\n</persisted-output>",
    "[Old tool result content cleared]",
    '{"looks": ["like", "json"]}',
)
SURROGATE_SAMPLES = ("\ud800", "\udfff", "x\udc41y", "\udbff\udfff", "a\ud83dz")
"""Lone surrogates that JSON escapes can carry (\\udc41 is outside surrogateescape's range)."""


# ---------------------------------------------------------------------------------------------
# Helpers: the watchdog, raw JSON fragments, sandboxes
# ---------------------------------------------------------------------------------------------


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so that no ``except Exception`` swallows it."""


@contextlib.contextmanager
def watchdog(seconds: float = WATCHDOG_SECONDS) -> Iterator[None]:
    """Fail (raise :class:`Hang`) when the block runs longer than ``seconds``."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _fire(_signum: int, _frame: Any) -> None:
        raise Hang(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Raw:
    """A JSON fragment spliced into a record as is (deep nesting, invalid UTF-8 in a string)."""

    data: bytes


def dump(obj: Any, *, ensure_ascii: bool = True) -> bytes:
    """``obj`` as one JSONL line (bytes, no newline), with every :class:`Raw` spliced in.

    Strings may hold lone surrogates: they become ``\\udXXX`` escapes (ensure_ascii) or their
    CESU-8 bytes (which the loader's surrogateescape turns into three other surrogates).
    """
    raws: list[bytes] = []

    def swap(o: Any) -> Any:
        if isinstance(o, Raw):
            raws.append(o.data)
            return f"@@raw-9f1c-{len(raws) - 1}@@"
        if isinstance(o, dict):
            return {k: swap(v) for k, v in o.items()}
        if isinstance(o, list):
            return [swap(v) for v in o]
        return o

    text = json.dumps(swap(obj), ensure_ascii=ensure_ascii)
    data = text.encode("utf-8", errors="surrogatepass")
    for i, raw in enumerate(raws):
        data = data.replace(f'"@@raw-9f1c-{i}@@"'.encode(), raw, 1)
    return data


def as_loaded(s: str, ensure_ascii: bool) -> str:
    """What a string written by :func:`dump` reads back as (surrogates may change)."""
    if ensure_ascii:
        return s
    return s.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="surrogateescape")


def nested(depth: int, *, dicts: bool = False) -> Raw:
    """``depth`` levels of nested lists (or objects) as raw JSON: no Python recursion."""
    if dicts:
        return Raw(b'{"a":' * depth + b"1" + b"}" * depth)
    return Raw(b"[" * depth + b"]" * depth)


def huge(unit: str, size: int) -> str:
    """A string of ``size`` characters made of ``unit`` (cheap: no per-char drawing)."""
    return (unit * (size // max(1, len(unit)) + 1))[:size]


def make_sandbox() -> tuple[tempfile.TemporaryDirectory[str], Path]:
    """A fresh temp dir and, 9 levels down, the session base directory.

    A tool_use_id with up to 8 ``..`` components that reached the file system unmapped would
    land inside the sandbox, where the containment check sees it.
    """
    shm = "/dev/shm"
    fast = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    tmp = tempfile.TemporaryDirectory(prefix="sluicegate-fuzz-", dir=fast)
    base = Path(tmp.name).joinpath(*"abcdefgh", "base")
    base.mkdir(parents=True)
    return tmp, base


def assert_contained(sandbox: Path, base: Path, ctx: SessionContext, allowed: set[Path]) -> None:
    """Nothing written but ``allowed`` files and result files in the session's tool-results."""
    tool_dir = base / "store" / SID / TOOL_RESULTS_SUBDIR
    allowed_dirs = {sandbox, *base.parents, base, base / "store", base / "store" / SID, tool_dir}
    for dirpath, dirnames, filenames in os.walk(sandbox):
        here = Path(dirpath)
        for d in dirnames:
            assert here / d in allowed_dirs, f"unexpected directory {here / d}"
        for name in filenames:
            p = here / name
            if p in allowed:
                continue
            assert here == tool_dir, f"file written outside {tool_dir}: {p}"
            assert not name.startswith(".tmp-"), f"temp file left behind: {p}"
            assert re.fullmatch(
                r"(unsafe\.[0-9a-f]{64}|[A-Za-z0-9_-]{1,128})(\.[0-9a-f]{12})?\.(txt|json)", name
            ), p
            assert not (here / name).is_symlink()
    for persisted in ctx.report.persisted:
        assert Path(persisted.path).parent == tool_dir.absolute(), persisted.path
        assert Path(persisted.path).is_file(), persisted.path


# ---------------------------------------------------------------------------------------------
# A. Generated JSONL lines, each knowing what it is
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Opts:
    """What the line generators may produce."""

    huge_sizes: tuple[int, ...] = (300_000, 2_500_000)
    """Sizes of the rare huge strings (characters)."""


LOADER_OPTS = Opts()
PIPELINE_OPTS = Opts(huge_sizes=(300_000, 1_000_000))


@dataclass(frozen=True)
class Line:
    """One generated line and what the loader must make of it."""

    data: bytes
    kind: str
    """'message' (loads as a message), 'other' (a valid non-message record), 'bad' (must be
    a problem), 'maybe' (a message record that may load or be a problem), 'blank'."""
    label: str
    uuid: str | None = None
    """The uuid a message line must load with (None: the loader makes one up)."""
    sidechain: bool = False
    session_id: str | None = None
    replacements: int = 0
    stage_records: int = 0
    unknown_type: str | None = None


def rare(
    common: st.SearchStrategy[Any], uncommon: st.SearchStrategy[Any], one_in: int = 12
) -> st.SearchStrategy[Any]:
    """``uncommon`` about once in ``one_in`` draws."""
    return st.integers(1, one_in).flatmap(lambda k: uncommon if k == 1 else common)


@functools.cache
def texts(opts: Opts, *, allow_huge: bool = True) -> st.SearchStrategy[str]:
    small = st.one_of(
        st.text(max_size=30), st.sampled_from(UNICODE_SAMPLES), st.sampled_from(SURROGATE_SAMPLES)
    )
    if not allow_huge:
        return small
    big = st.sampled_from(opts.huge_sizes).flatmap(
        lambda n: st.builds(
            huge,
            # MB-sized: cheap units (an ASCII-escaped emoji is 12 bytes a char); the explicit
            # test_load_transcript_few_mb_strings_and_unicode covers MB of unicode
            st.sampled_from(
                ("x", "ab\n", "a b\t") if n > 1_000_000 else ("x", "🙂", "שלום ", "e\u0301")
            ),
            st.just(n),
        )
    )
    return rare(small, big, one_in=30)


@functools.cache
def raw_bytes_string() -> st.SearchStrategy[Raw]:
    """A JSON string holding invalid UTF-8 (loads as surrogateescape surrogates)."""
    return st.builds(
        lambda pre, junk, post: Raw(b'"' + pre.encode() + junk + post.encode() + b'"'),
        st.text(alphabet="abc xyz", max_size=5),
        st.sampled_from(
            [b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80\x80"]
        ),
        st.text(alphabet="abc xyz", max_size=5),
    )


@functools.cache
def string_values(opts: Opts) -> st.SearchStrategy[Any]:
    return rare(texts(opts), raw_bytes_string(), one_in=8)


def uuids(index: int) -> st.SearchStrategy[str]:
    """A unique uuid for line ``index`` (prefix ``v<index>.``), sometimes with odd characters."""
    suffixes = st.one_of(
        st.just(""),
        st.sampled_from(["ξ", "🙂", "\u202e", "e\u0301", " ", "\t", "../x", "\x00"]),
        st.sampled_from(["\ud800", "\udcff"]),
    )
    return suffixes.map(lambda s: f"v{index}.{s}")


usage_keys = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)


@functools.cache
def usage_values() -> st.SearchStrategy[Any]:
    """Counts the loader accepts: null, or an int from 0 to MAX_TOKENS (documented)."""
    return st.one_of(
        st.none(), st.integers(0, 200_000), st.sampled_from([170_000, 2**31, MAX_TOKENS])
    )


@functools.cache
def usages(opts: Opts) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.fixed_dictionaries({}, optional={k: usage_values() for k in usage_keys}),
        st.fixed_dictionaries(
            {"input_tokens": usage_values()}, optional={"server_tool_use": st.just({"x": 1})}
        ),
    )


TIMESTAMPS = (
    None,
    "2026-01-01T00:00:00.000Z",
    "2026-01-01T00:30:00.000Z",
    "2026-01-01T03:00:00.000Z",
    "2026-01-01T03:00:00+05:30",
    "2026-01-01",
    "2026-01-01T00:00:00",
    "not a time",
    "0001-01-01T00:00:00+23:59",
    "9999-12-31T23:59:59-23:59",
    "",
    "2026-02-30T00:00:00Z",
    "\x00",
)


@functools.cache
def timestamps() -> st.SearchStrategy[str | None]:
    return st.sampled_from(TIMESTAMPS)


TOOL_NAMES = ("Bash", "Read", "Grep", "Glob", "Edit", "WebFetch", "mcp__x__y", "Other", "", "🙂")
LOADED_IDS = (
    "toolu_1",
    "toolu_2",
    "toolu_3",
    "../../etc/passwd",
    "",
    "a\x00b",
    "/tmp/x",
    "x" * 10_240,
)


def png_b64(width: int, height: int, tail: bytes = b"") -> str:
    head = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + struct.pack(">II", width, height)
    return base64.b64encode(head + tail).decode()


IMAGE_DATA = (
    png_b64(1, 1),
    png_b64(0, 0),
    png_b64(2**32 - 1, 2**32 - 1),
    base64.b64encode(b"GIF89a\xff\xff\xff\xff").decode(),
    base64.b64encode(b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\xff" * 20).decode(),
    base64.b64encode(b"RIFF\x00\x00\x00\x00WEBPVP8L" + b"\xff" * 20).decode(),
    base64.b64encode(b"RIFF\x00\x00\x00\x00WEBPVP8 " + b"\xff" * 20).decode(),
    base64.b64encode(b"\xff\xd8\xff\xc0\x00\x11\x08\xff\xff\xff\xff" + b"\x00" * 40).decode(),
    base64.b64encode(b"\xff\xd8" + b"\xff\xe0\xff\xff" * 30).decode(),
    base64.b64encode(b"\xff\xd8\xff").decode(),
    "!!!not base64!!!",
    "",
    "🙂" * 50,
)


@functools.cache
def image_blocks() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda data, media: {
                "type": "image",
                "source": {"type": "base64", "media_type": media, "data": data},
            },
            st.sampled_from(IMAGE_DATA),
            st.sampled_from(["image/png", "image/jpeg", "text/plain", ""]),
        ),
        st.just({"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}),
        st.just({"type": "image"}),
        st.just({"type": "image", "source": "nope"}),
        st.just({"type": "image", "source": {"type": "base64", "data": 5}}),
    )


@functools.cache
def loadable_blocks(opts: Opts, role: str) -> st.SearchStrategy[dict[str, Any]]:
    """Blocks the loader accepts (string 'type'; ids where it checks them)."""
    deep = st.integers(1, SAFE_DEPTH).map(nested)
    value = st.one_of(string_values(opts), st.integers(), st.none(), deep, st.just(float("nan")))
    text = st.builds(lambda t: {"type": "text", "text": t}, string_values(opts))
    unknown = st.builds(
        lambda t, v: {"type": t, "data": v},
        st.sampled_from(["server_tool_use", "web_search_tool_result", "💥", "", "TEXT"]),
        value,
    )
    if role == "assistant":
        tool_use = st.builds(
            lambda i, n, inp: {"type": "tool_use", "id": i, "name": n, "input": inp},
            st.sampled_from(LOADED_IDS),
            st.one_of(st.sampled_from(TOOL_NAMES), st.integers(), st.none()),
            st.one_of(st.dictionaries(st.text(max_size=5), value, max_size=3), value),
        )
        thinking = st.builds(
            lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, texts(opts)
        )
        return st.one_of(text, tool_use, thinking, unknown)
    inner = st.one_of(text, image_blocks(), st.just({"type": "text"}), st.just({"type": "💥"}))
    result_content = st.one_of(
        st.none(),
        st.just(""),
        string_values(opts),
        st.lists(inner, max_size=3),
        st.just("<persisted-output>\nPreview\n</persisted-output>"),
    )
    tool_result = st.builds(
        lambda i, c, err: {"type": "tool_result", "tool_use_id": i, "content": c, "is_error": err},
        st.sampled_from(LOADED_IDS),
        result_content,
        st.one_of(st.booleans(), st.none(), st.just("yes")),
    )
    return st.one_of(text, tool_result, image_blocks(), unknown)


@functools.cache
def contents(opts: Opts, role: str) -> st.SearchStrategy[Any]:
    return st.one_of(string_values(opts), st.lists(loadable_blocks(opts, role), max_size=4))


@st.composite
def message_record(draw: st.DrawFn, index: int, opts: Opts) -> tuple[dict[str, Any], Line]:
    """A valid message record (as an object) and its Line metadata (data filled in later)."""
    rtype = draw(
        st.sampled_from(
            ["user", "user", "assistant", "assistant", "system", "attachment", "progress"]
        )
    )
    uuid_kind = draw(
        st.sampled_from(["given", "given", "given", "given", "missing", "empty", "null"])
    )
    uuid = draw(uuids(index)) if uuid_kind == "given" else None
    side = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else False
    session = draw(st.sampled_from([SID, SID, None, OTHER_SID]))
    rec: dict[str, Any] = {"parentUuid": None, "isSidechain": side, "type": rtype}
    if session is not None:
        rec["sessionId"] = session
    if uuid_kind == "given":
        rec["uuid"] = uuid
    elif uuid_kind != "missing":
        rec["uuid"] = "" if uuid_kind == "empty" else None
    ts = draw(timestamps())
    if ts is not None:
        rec["timestamp"] = ts
    if draw(st.booleans()):
        rec["isMeta"] = draw(st.booleans())
    if rtype == "user":
        rec["message"] = {"role": "user", "content": draw(contents(opts, "user"))}
        if draw(st.integers(0, 9)) == 0:
            rec["isCompactSummary"] = True
    elif rtype == "assistant":
        rec["message"] = {
            "id": draw(st.sampled_from(["msg_1", "msg_2", "msg_3", None, "msg_🙂"])),
            "type": "message",
            "role": "assistant",
            "model": draw(
                st.sampled_from(
                    ["claude-opus-4-6", "claude-sonnet-4-5", "<synthetic>", None, "gpt"]
                )
            ),
            "content": draw(contents(opts, "assistant")),
            "stop_reason": draw(st.sampled_from(["tool_use", "end_turn", None])),
            "usage": draw(usages(opts)),
        }
    elif rtype == "system":
        rec["subtype"] = draw(st.sampled_from(["compact_boundary", "local_command", "info", None]))
        rec["content"] = draw(
            st.one_of(string_values(opts), st.integers(), st.none(), st.just([1]))
        )
    elif rtype == "attachment":
        att = draw(
            st.one_of(
                st.none(),
                st.just("str"),
                st.fixed_dictionaries(
                    {
                        "content": st.one_of(
                            st.none(), st.just(""), st.just(0), contents(opts, "user")
                        )
                    }
                ),
            )
        )
        if att is not None:
            rec["attachment"] = att
    else:
        rec["data"] = draw(
            st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
        )
    if draw(st.integers(0, 5)) == 0:
        rec["unknownField"] = draw(st.one_of(st.integers(), st.text(max_size=5), st.just([{}])))
    line = Line(b"", "message", f"valid {rtype}", uuid=uuid, sidechain=side, session_id=session)
    return rec, line


def mutations() -> list[tuple[str, Callable[[dict[str, Any]], dict[str, Any] | None]]]:
    """Ways to break a user / assistant record that the loader must reject."""

    def setp(path: Sequence[str], value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def f(rec: dict[str, Any]) -> dict[str, Any]:
            rec = json.loads(json.dumps(rec))  # deep copy (records hold no Raw here)
            target = rec
            for key in path[:-1]:
                target = target[key]
            if value is _DELETE:
                target.pop(path[-1], None)
            else:
                target[path[-1]] = value
            return rec

        return f

    out: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any] | None]]] = [
        ("message missing", setp(["message"], _DELETE)),
        ("type missing", setp(["type"], _DELETE)),
        ("type null", setp(["type"], None)),
        ("type int", setp(["type"], 5)),
        ("type list", setp(["type"], ["user"])),
        ("uuid list", setp(["uuid"], ["x"])),
        ("uuid int", setp(["uuid"], 7)),
        ("uuid dict", setp(["uuid"], {"a": 1})),
        ("timestamp int", setp(["timestamp"], 1700000000)),
        ("message str", setp(["message"], "hello")),
        ("message list", setp(["message"], [{"content": "x"}])),
        ("message int", setp(["message"], 3)),
        ("message null", setp(["message"], None)),
        ("content missing", setp(["message", "content"], _DELETE)),
        ("content int", setp(["message", "content"], 42)),
        ("content dict", setp(["message", "content"], {"type": "text", "text": "x"})),
        ("content list of ints", setp(["message", "content"], [1, 2, 3])),
        ("content true", setp(["message", "content"], True)),
        ("content nested list", setp(["message", "content"], [[{"type": "text", "text": "x"}]])),
        ("block without type", setp(["message", "content"], [{"text": "x"}])),
        ("block type int", setp(["message", "content"], [{"type": 1}])),
        ("block str", setp(["message", "content"], ["text"])),
        (
            "tool_use without id",
            setp(["message", "content"], [{"type": "tool_use", "name": "Bash"}]),
        ),
        ("tool_use id int", setp(["message", "content"], [{"type": "tool_use", "id": 5}])),
        (
            "tool_result without id",
            setp(["message", "content"], [{"type": "tool_result", "content": "x"}]),
        ),
        (
            "tool_result id list",
            setp(["message", "content"], [{"type": "tool_result", "tool_use_id": ["a"]}]),
        ),
        (
            "tool_result content int",
            setp(
                ["message", "content"], [{"type": "tool_result", "tool_use_id": "a", "content": 5}]
            ),
        ),
        (
            "tool_result content dict",
            setp(
                ["message", "content"],
                [{"type": "tool_result", "tool_use_id": "a", "content": {"type": "text"}}],
            ),
        ),
        (
            "tool_result content ints",
            setp(
                ["message", "content"],
                [{"type": "tool_result", "tool_use_id": "a", "content": [1, 2]}],
            ),
        ),
        (
            "tool_result content block without type",
            setp(
                ["message", "content"],
                [{"type": "tool_result", "tool_use_id": "a", "content": [{"text": "x"}]}],
            ),
        ),
    ]
    assistant_only = [
        ("usage str", setp(["message", "usage"], "100")),
        ("usage list", setp(["message", "usage"], [1])),
        ("usage value str", setp(["message", "usage"], {"input_tokens": "5"})),
        ("usage negative", setp(["message", "usage"], {"output_tokens": -1})),
        ("usage float", setp(["message", "usage"], {"input_tokens": 1.5})),
        ("usage float integral", setp(["message", "usage"], {"input_tokens": 2.0})),
        ("usage bool", setp(["message", "usage"], {"cache_read_input_tokens": True})),
        ("usage dict value", setp(["message", "usage"], {"input_tokens": {"n": 1}})),
        ("usage inf", setp(["message", "usage"], {"input_tokens": float("inf")})),
        ("usage past the limit", setp(["message", "usage"], {"input_tokens": MAX_TOKENS + 1})),
        ("usage 2**63", setp(["message", "usage"], {"cache_read_input_tokens": 2**63})),
        ("usage 10**309", setp(["message", "usage"], {"output_tokens": 10**309})),
        ("usage 10**4000", setp(["message", "usage"], {"output_tokens": 10**4000})),
        ("message id int", setp(["message", "id"], 5)),
        ("model list", setp(["message", "model"], ["m"])),
        ("stop_reason dict", setp(["message", "stop_reason"], {})),
    ]
    return [(f"user: {n}", f) for n, f in out] + [
        (f"assistant: {n}", f) for n, f in out + assistant_only
    ]


_DELETE = object()
_MUTATIONS = mutations()


@st.composite
def bad_field_line(draw: st.DrawFn, index: int) -> Line:
    name, mutate = draw(st.sampled_from(_MUTATIONS))
    rtype = name.split(":")[0]
    base: dict[str, Any] = {
        "type": rtype,
        "uuid": f"bad{index}",
        "timestamp": "2026-01-01T00:00:00Z",
        "message": {"role": rtype, "content": "x"},
    }
    if rtype == "assistant":
        base["message"].update(id="msg_1", model="claude-opus-4-6", usage={"input_tokens": 1})
    base["sessionId"] = OTHER_SID  # a skipped line must not name the session
    rec = mutate(base)
    return Line(dump(rec, ensure_ascii=draw(st.booleans())), "bad", f"bad field ({name})")


@st.composite
def other_record_line(draw: st.DrawFn, index: int, opts: Opts) -> Line:
    """A valid non-message record: content-replacement, stage-record or an unknown type."""
    kind = draw(st.sampled_from(["replacement", "stage", "unknown"]))
    session = draw(st.sampled_from([SID, None, OTHER_SID]))
    rec: dict[str, Any] = {}
    line_kw: dict[str, Any] = {}
    if kind == "replacement":
        entries = draw(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "tool_use_id": st.sampled_from((*LOADED_IDS[:3], "🙂")),
                        "replacement": texts(opts, allow_huge=False),
                    },
                    optional={"kind": st.sampled_from(["tool-result", "other"])},
                ),
                max_size=3,
            )
        )
        rec = {"type": "content-replacement", "replacements": entries}
        line_kw["replacements"] = len(entries)
    elif kind == "stage":
        rec = {
            "type": "stage-record",
            "stage": draw(st.sampled_from(["microcompact", "history_snip", "autocompact", "🙂"])),
            "data": draw(
                st.dictionaries(
                    st.text(max_size=5),
                    st.one_of(
                        st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2)
                    ),
                    max_size=3,
                )
            ),
        }
        line_kw["stage_records"] = 1
    else:
        rtype = draw(
            st.one_of(
                st.sampled_from(
                    ["file-history-snapshot", "summary", "queue-operation", "", "USER", "🙂"]
                ),
                st.text(max_size=8),
            ).filter(lambda t: t not in KNOWN_MESSAGE_TYPES and t not in SPECIAL_TYPES)
        )
        rec = {"type": rtype, "uuid": f"other{index}", "whatever": [1, {"a": None}]}
        line_kw["unknown_type"] = rtype
    if session is not None:
        rec["sessionId"] = session
    return Line(
        dump(rec, ensure_ascii=draw(st.booleans())),
        "other",
        f"valid {kind}",
        session_id=session,
        **line_kw,
    )


@st.composite
def bad_other_line(draw: st.DrawFn) -> Line:
    """A special record of the wrong shape (rejected as a whole)."""
    rec = draw(
        st.sampled_from(
            [
                {"type": "content-replacement"},
                {"type": "content-replacement", "replacements": "x"},
                {"type": "content-replacement", "replacements": {"tool_use_id": "a"}},
                {"type": "content-replacement", "replacements": [5]},
                {
                    "type": "content-replacement",
                    "replacements": [{"tool_use_id": 5, "replacement": "r"}],
                },
                {
                    "type": "content-replacement",
                    "replacements": [{"tool_use_id": "", "replacement": "r"}],
                },
                {"type": "content-replacement", "replacements": [{"tool_use_id": "a"}]},
                {
                    "type": "content-replacement",
                    "replacements": [{"tool_use_id": "a", "replacement": "r", "kind": 3}],
                },
                {"type": "stage-record"},
                {"type": "stage-record", "stage": 5, "data": {}},
                {"type": "stage-record", "stage": "x", "data": [1]},
                # leading valid entries: a skipped line must not keep them
                {
                    "type": "content-replacement",
                    "replacements": [{"tool_use_id": "a", "replacement": "r"}, 5],
                },
                {
                    "type": "content-replacement",
                    "replacements": [
                        {"tool_use_id": "a", "replacement": "r"},
                        {"tool_use_id": "b"},
                    ],
                },
            ]
        )
    )
    return Line(
        dump(rec), "bad", f"bad special record {rec.get('replacements', rec.get('stage'))!r}"
    )


@functools.cache
def wrong_shape_lines() -> st.SearchStrategy[Line]:
    values = st.one_of(
        st.lists(st.integers(), max_size=3),
        st.integers(),
        st.floats(allow_nan=True),
        st.none(),
        st.text(max_size=10),
        st.booleans(),
        st.just([{"type": "user", "message": {"content": "x"}}]),
    )
    return values.map(
        lambda v: Line(json.dumps(v).encode(), "bad", f"wrong shape {type(v).__name__}")
    )


def json_depth(data: bytes) -> int:
    """How many arrays / objects deep a JSON text goes (brackets inside strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def _is_blank(data: bytes) -> bool:
    return not data.decode("utf-8", errors="surrogateescape").strip()


def _parses_to_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data.decode("utf-8", errors="surrogateescape")), dict)
    except (ValueError, RecursionError):
        return False


@functools.cache
def garbage_lines() -> st.SearchStrategy[Line]:
    def classify(data: bytes) -> Line:
        if _is_blank(data):
            return Line(data, "blank", "whitespace garbage")
        return Line(data, "bad", "garbage bytes")

    forbidden = b"\n"  # a bare CR stays inside its line (JSONL lines end at LF)
    return (
        st.one_of(
            st.binary(min_size=1, max_size=120),
            st.sampled_from(
                [
                    b"\x00",
                    b"\x00\x00{}",
                    b"\xff\xfe",
                    b"{",
                    b"}",
                    b'{"type":',
                    b"nul\x00l",
                    b"NaN",
                    b"\xef\xbb\xbf{}",
                    b"[" * 50,
                ]
            ),
        )
        .map(lambda b: bytes(c for c in b if c not in forbidden) or b"?")
        .filter(lambda b: not _parses_to_object(b))
        .map(classify)
    )


@st.composite
def corrupted_line(draw: st.DrawFn, index: int, opts: Opts) -> Line:
    """A valid record broken at the byte level: truncated, a NUL or invalid UTF-8 spliced in,
    or a number past Python's int-string limit."""
    rec, _ = draw(message_record(index, opts))
    data = dump(rec, ensure_ascii=draw(st.booleans()))
    how = draw(
        st.sampled_from(["truncate", "nul", "bad utf-8 first", "huge number", "two records"])
    )
    if how == "truncate":
        cut = draw(st.integers(1, len(data) - 1))
        return Line(data[:cut], "bad", "truncated record")
    if how == "nul":
        at = draw(st.integers(0, len(data)))
        return Line(data[:at] + b"\x00" + data[at:], "bad", "NUL spliced in")
    if how == "bad utf-8 first":
        return Line(b"\xff" + data, "bad", "invalid UTF-8 before the record")
    if how == "two records":
        return Line(data + b" " + data, "bad", "two records on one line")
    digits = draw(st.sampled_from([4301, 5000, 50_000]))
    return Line(data[:-1] + b',"n":' + b"9" * digits + b"}", "bad", "number past the digit limit")


@st.composite
def deep_line(draw: st.DrawFn, index: int) -> Line:
    """A message record with deep nesting in a tool_use input, an unknown block or a text."""
    fixed = (1, 50, SAFE_DEPTH, MAX_NESTING - 8, MAX_NESTING, MAX_NESTING + 8, 990, HOPELESS_DEPTH)
    # and just under the recursion limit, which hypothesis raises while a test runs: read it
    # when drawing (json.loads itself would still accept most of these)
    near = st.integers(0, 400).map(lambda k: max(1, sys.getrecursionlimit() - k))
    depth = draw(st.one_of(st.sampled_from(fixed), near))
    raw = nested(depth, dicts=draw(st.booleans()))
    uuid = f"v{index}.deep"
    where = draw(st.sampled_from(["tool_use input", "unknown block", "text"]))
    if where == "tool_use input":
        rec: dict[str, Any] = {
            "type": "assistant",
            "uuid": uuid,
            "message": {
                "id": "msg_d",
                "model": "claude-opus-4-6",
                "content": [{"type": "tool_use", "id": "toolu_d", "name": "Bash", "input": raw}],
            },
        }
    elif where == "unknown block":
        rec = {
            "type": "user",
            "uuid": uuid,
            "message": {"role": "user", "content": [{"type": "weird", "x": raw}]},
        }
    else:
        rec = {
            "type": "user",
            "uuid": uuid,
            "message": {"role": "user", "content": [{"type": "text", "text": raw}]},
        }
    data = dump(rec)
    levels = json_depth(data)
    # documented: a record nested deeper than MAX_NESTING levels is malformed (the exact
    # boundary -- whether the innermost value counts as a level -- is left to the loader)
    kind = (
        "message" if levels <= MAX_NESTING - 2 else "bad" if levels >= MAX_NESTING + 2 else "maybe"
    )
    shown = depth if depth in fixed else "near the recursion limit"
    event(f"deep nesting {shown}")
    return Line(data, kind, f"nesting {shown} in {where}", uuid=uuid)


@st.composite
def any_line(draw: st.DrawFn, index: int, opts: Opts) -> Line:
    kind = draw(
        st.sampled_from(
            ["message"] * 8
            + ["other"] * 2
            + ["bad field"] * 3
            + ["bad other", "shape", "garbage", "garbage", "corrupt", "corrupt", "deep", "blank"]
        )
    )
    if kind == "message":
        rec, line = draw(message_record(index, opts))
        ascii_only = draw(st.booleans())
        uuid = None if line.uuid is None else as_loaded(line.uuid, ascii_only)
        data = dump(rec, ensure_ascii=ascii_only)
        if draw(st.integers(0, 9)) == 0:
            data = data.replace(b', "', b',\r"', 1)  # a bare CR is JSON whitespace
        return dataclasses.replace(line, data=data, uuid=uuid)
    if kind == "other":
        return draw(other_record_line(index, opts))
    if kind == "bad field":
        return draw(bad_field_line(index))
    if kind == "bad other":
        return draw(bad_other_line())
    if kind == "shape":
        return draw(wrong_shape_lines())
    if kind == "garbage":
        return draw(garbage_lines())
    if kind == "corrupt":
        return draw(corrupted_line(index, opts))
    if kind == "deep":
        return draw(deep_line(index))
    return Line(draw(st.sampled_from([b"", b"   ", b"\t", b" \t \x0b\x0c"])), "blank", "blank line")


def clock(minutes: int) -> str:
    """An ISO timestamp ``minutes`` after a fixed start (as Claude Code writes them)."""
    hours, mins = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"2026-01-{1 + days:02d}T{hours:02d}:{mins:02d}:00.000Z"


@st.composite
def tool_round(
    draw: st.DrawFn,
    index: int,
    opts: Opts,
    *,
    at: int | None = None,
    usage: dict[str, int] | None = None,
) -> list[Line]:
    """An assistant record with tool_uses and the user record answering them (often large).

    ``at``: minutes on the session clock (a long session); else random timestamps and ids.
    """
    n = draw(st.integers(1, 3))
    if at is None:
        ids = [draw(st.sampled_from(LOADED_IDS)) for _ in range(n)]
        stamps = (draw(timestamps()), draw(timestamps()))
        usage = draw(usages(opts))
    else:
        ids = [
            draw(rare(st.just(f"toolu_{index}_{k}"), st.sampled_from(LOADED_IDS), one_in=6))
            for k in range(n)
        ]
        stamps = (clock(at), clock(at + 1))
    mid = draw(st.sampled_from(["msg_1", "msg_2", "msg_r"])) if at is None else f"msg_{index}"
    a_uuid, u_uuid = draw(uuids(index)) + "a", draw(uuids(index)) + "u"
    uses = [
        {
            "type": "tool_use",
            "id": i,
            "name": draw(st.sampled_from(TOOL_NAMES)),
            "input": {"command": "x"},
        }
        for i in ids
    ]
    a = {
        "type": "assistant",
        "uuid": a_uuid,
        "sessionId": SID,
        "timestamp": stamps[0],
        "message": {"id": mid, "model": "claude-opus-4-6", "content": uses, "usage": usage},
    }
    sizes = (1_000, 60_000, *opts.huge_sizes) if at is None else (1_000, 20_000, 60_000)
    units = ("x", "line\n", "🙂", "x\ud800", "y\udcff")
    big = st.builds(huge, st.sampled_from(units), st.sampled_from(sizes))
    results = [
        {
            "type": "tool_result",
            "tool_use_id": i,
            "content": draw(
                st.one_of(
                    big,
                    texts(opts, allow_huge=False),
                    st.lists(st.builds(lambda t: {"type": "text", "text": t}, big), max_size=2),
                )
            ),
        }
        for i in ids
    ]
    u = {
        "type": "user",
        "uuid": u_uuid,
        "sessionId": SID,
        "timestamp": stamps[1],
        "message": {"role": "user", "content": results},
    }
    return [
        Line(dump(a), "message", "tool round: assistant", uuid=a_uuid, session_id=SID),
        Line(dump(u), "message", "tool round: results", uuid=u_uuid, session_id=SID),
    ]


@st.composite
def jsonl_files(
    draw: st.DrawFn, opts: Opts, max_chunks: int = 8, *, long_sessions: bool = False
) -> list[Line]:
    """A file of random lines; or (one in three) a long session of tool rounds on a clock,
    with hostile lines between them, a large usage at the end and sometimes an idle gap, so
    that history snip, microcompact and autocompact have something to do."""
    lines: list[Line] = []
    long = long_sessions and draw(st.integers(0, 2)) == 0
    chunks = draw(st.integers(9, 13)) if long else draw(st.integers(0, max_chunks))
    for k in range(chunks):
        index = len(lines) + 1
        if long:
            last = k == chunks - 1
            big = {"input_tokens": draw(st.sampled_from([170_000, 185_000]))}
            usage = big if last and draw(st.integers(0, 3)) else {"input_tokens": 1_000 * k}
            lines += draw(tool_round(index, opts, at=10 * k, usage=usage))
            if draw(st.integers(0, 2)) == 0:
                lines.append(draw(any_line(len(lines) + 1, opts)))
        elif draw(st.integers(0, 4)) == 0:
            lines += draw(tool_round(index, opts))
        else:
            lines.append(draw(any_line(index, opts)))
    if long:
        gap = draw(st.sampled_from([5, 120]))
        uuid = f"v{len(lines) + 1}.prompt"
        prompt = {
            "type": "user",
            "uuid": uuid,
            "sessionId": SID,
            "timestamp": clock(10 * chunks + gap),
            "message": {"role": "user", "content": "next"},
        }
        lines.append(Line(dump(prompt), "message", "long session: prompt", uuid=uuid))
    event(f"long session: {long}")
    for line in lines:
        event(line.label.split(" (")[0])
    return lines


def write_lines(path: Path, lines: Sequence[Line], *, final_newline: bool = True) -> None:
    data = b"\n".join(line.data for line in lines)
    assert all(b"\n" not in line.data for line in lines)
    path.write_bytes(data + (b"\n" if final_newline and lines else b""))


# ---------------------------------------------------------------------------------------------
# A. The loader contract
# ---------------------------------------------------------------------------------------------


def check_lenient(path: Path | str, lines: Sequence[Line]) -> Any:
    """Load with strict=False and check it against what every line is; return the transcript."""
    with watchdog():
        t = load_transcript(path, strict=False)
    problems = {p.line: p.reason for p in t.problems}
    assert len(problems) == len(t.problems), "a line reported twice"
    for p in t.problems:
        assert isinstance(p.reason, str) and p.reason.startswith("malformed record: "), p
    main: list[str | None] = []
    side: list[str | None] = []
    replacements = stage_records = 0
    unknown: Counter[str] = Counter()
    session: str | None = None
    for lineno, line in enumerate(lines, start=1):
        bad = lineno in problems
        if line.kind == "bad":
            assert bad, f"line {lineno} ({line.label}) was not reported: {line.data[:200]!r}"
        elif line.kind in ("message", "other", "blank"):
            assert not bad, f"line {lineno} ({line.label}) reported: {problems.get(lineno)}"
        if bad or line.kind in ("bad", "blank"):
            continue
        if session is None and line.session_id is not None:
            session = line.session_id
        if line.kind == "other":
            replacements += line.replacements
            stage_records += line.stage_records
            if line.unknown_type is not None:
                unknown[line.unknown_type] += 1
            continue
        (side if line.sidechain else main).append(line.uuid)
    assert set(problems) <= set(range(1, len(lines) + 1))
    known = {line.uuid for line in lines if line.uuid is not None}
    got = [m.uuid if m.uuid in known else None for m in t.messages]
    for m in t.messages:
        assert isinstance(m, Message) and isinstance(m.uuid, str) and m.uuid
    assert got == (main if main or not side else side)
    assert t.sidechain_skipped == (len(side) if main or not side else 0)
    assert len(t.replacement_records) == replacements
    assert len(t.stage_records) == stage_records
    assert t.skipped_types == unknown
    assert t.session_id == session
    return t


def check_strict(path: Path | str, lines: Sequence[Line], lenient: Any) -> None:
    """Strict mode: loads exactly when the lenient load found nothing, else names the first bad
    line as ``<path>:<line>: <reason>`` (same line and reason as the lenient load)."""
    try:
        with watchdog():
            t = load_transcript(path)
    except TranscriptError as exc:
        assert lenient.problems, f"strict raised where lenient found nothing: {exc}"
        first = lenient.problems[0]
        assert exc.line == first.line
        assert exc.reason == first.reason
        assert exc.path == str(path)
        assert str(exc).startswith(f"{path}:{exc.line}: "), str(exc)[:300]
        assert isinstance(exc, ValueError)
        assert lines[exc.line - 1].kind in ("bad", "maybe")
        return
    assert not lenient.problems, f"strict loaded a file with bad lines: {lenient.problems}"
    known = {line.uuid for line in lines if line.uuid is not None}
    assert [m.uuid if m.uuid in known else None for m in t.messages] == [
        m.uuid if m.uuid in known else None for m in lenient.messages
    ]


@pytest.mark.slow
@settings(max_examples=round(LOADER_EXAMPLES * SCALE), **FUZZ_SETTINGS)
@given(
    lines=jsonl_files(LOADER_OPTS),
    as_str=st.booleans(),
    name=st.sampled_from(["t.jsonl", "trans cript ☃.jsonl", "ü.jsonl"]),
    final_newline=st.booleans(),
)
def test_fuzz_load_transcript(
    lines: list[Line], as_str: bool, name: str, final_newline: bool
) -> None:
    tmp, base = make_sandbox()
    with tmp:
        path = base / name
        write_lines(path, lines, final_newline=final_newline)
        arg: Path | str = str(path) if as_str else path
        try:
            lenient = check_lenient(arg, lines)
            check_strict(arg, lines, lenient)
        except AssertionError:
            raise
        except Exception as exc:  # the failure message is the point
            raise AssertionError(
                f"load_transcript raised {type(exc).__name__}: {exc!r}"[:2000]
            ) from exc
        event(f"lenient problems: {min(len(lenient.problems), 4)}")


def test_load_transcript_hopelessly_deep_nesting_is_a_clear_error(tmp_path: Path) -> None:
    """10,000 nested lists / objects: json.loads' RecursionError becomes the documented error."""
    for raw in (nested(HOPELESS_DEPTH), nested(HOPELESS_DEPTH, dicts=True)):
        line = Line(
            dump(
                {
                    "type": "user",
                    "uuid": "d",
                    "message": {"role": "user", "content": [{"type": "x", "v": raw}]},
                }
            ),
            "maybe",
            "deep",
            uuid="d",
        )
        ok = Line(
            dump({"type": "user", "uuid": "ok", "message": {"role": "user", "content": "hi"}}),
            "message",
            "ok",
            uuid="ok",
        )
        then = Line(
            dump({"type": "user", "uuid": "ok2", "message": {"role": "user", "content": "hi"}}),
            "message",
            "ok again",
            uuid="ok2",
        )
        path = tmp_path / "deep.jsonl"
        write_lines(path, [ok, line, then])
        lenient = load_transcript(path, strict=False)
        assert [p.line for p in lenient.problems] == [2]
        assert re.search("recursion|nested deeper", lenient.problems[0].reason)
        assert [m.uuid for m in lenient.messages] == ["ok", "ok2"]
        with pytest.raises(
            TranscriptError, match=rf"^{re.escape(str(path))}:2: malformed record: "
        ):
            load_transcript(path)


def test_load_transcript_few_mb_strings_and_unicode(tmp_path: Path) -> None:
    """Multi-MB strings and every unicode sample load back exactly."""
    recs = [
        {"type": "user", "uuid": f"u{i}", "message": {"role": "user", "content": text}}
        for i, text in enumerate(
            [huge("🙂a\u0301", 3_000_000), huge("x", 4_000_000), *UNICODE_SAMPLES]
        )
    ]
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\n".join(dump(r, ensure_ascii=False) for r in recs) + b"\n")
    with watchdog():
        t = load_transcript(path)
    assert [m.content for m in t.messages] == [r["message"]["content"] for r in recs]


def test_load_transcript_surrogates_load_as_documented(tmp_path: Path) -> None:
    """Invalid UTF-8 becomes surrogateescape surrogates, JSON escapes become lone surrogates."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(
        b'{"type":"user","uuid":"a","message":{"role":"user","content":"x\xffy"}}\n'
        b'{"type":"user","uuid":"b","message":{"role":"user","content":"\\ud800"}}\n'
    )
    t = load_transcript(path)
    assert [m.content for m in t.messages] == ["x\udcffy", "\ud800"]


def test_load_transcript_empty_and_blank_files(tmp_path: Path) -> None:
    for data in (b"", b"\n\n", b"   \n\t\n"):
        path = tmp_path / "e.jsonl"
        path.write_bytes(data)
        for strict in (True, False):
            t = load_transcript(path, strict=strict)
            assert t.messages == [] and t.problems == [] and t.session_id is None


# ---------------------------------------------------------------------------------------------
# B. The default pipeline
# ---------------------------------------------------------------------------------------------


class EchoSummarizer:
    """A summarizer that answers at once with a short text."""

    async def summarize(self, messages: Sequence[Any]) -> str:
        return f"summary of {len(messages)} messages"


INTERNAL_ERRORS = (
    KeyError,
    AttributeError,
    IndexError,
    RecursionError,
    ArithmeticError,
    UnicodeError,
    AssertionError,
    NameError,
    LookupError,
)
"""Exception types that mean "crashed", not "refused bad input with a clear error"."""


def new_context(base: Path, *, writer: bool) -> SessionContext:
    """A session under ``base/store`` with a real file store (and transcript, if asked)."""
    root = base / "store"
    return SessionContext(
        SID,
        root,
        store=FileToolResultStore(root, SID),
        transcript=TranscriptWriter(base / "transcript.jsonl", SID) if writer else None,
    )


def run_default_pipeline(
    messages: list[Message],
    base: Path,
    *,
    writer: bool,
    summarizer: Any = None,
    passes: int = 1,
    ctx: SessionContext | None = None,
) -> tuple[list[list[Message]], list[list[Any]], SessionContext]:
    """``passes`` runs of the default pipeline with one context, each followed by to_api."""
    ctx = ctx or new_context(base, writer=writer)
    pipe = Pipeline(default_stages(summarizer=summarizer))
    outs, wires = [], []
    for _ in range(passes):
        with watchdog():
            out = anyio.run(pipe.run, messages, ctx)
            wire = to_api(out)
        assert isinstance(out, list) and all(isinstance(m, Message) for m in out)
        outs.append(out)
        wires.append(wire)
        stage_events(ctx)
    return outs, wires, ctx


def stage_events(ctx: SessionContext) -> None:
    """Which stages acted in the latest pass (hypothesis statistics: is the fuzz reaching them)."""
    if not currently_in_test_context():
        return
    made = ctx.report.decisions
    event(f"budget persisted: {bool(ctx.report.persisted)}")
    micro = made.get("microcompact")
    event(f"microcompact: {micro.decision if micro else None}")
    snip = made.get("history_snip")
    event(f"history_snip removed: {bool(snip and snip.facts.get(ATTR.REMOVED_TOTAL))}")
    auto = ctx.stage_state.get("autocompact")
    event(f"autocompact projection: {getattr(auto, 'projection', None) is not None}")


@pytest.mark.slow
@settings(max_examples=round(PIPELINE_LOADED_EXAMPLES * SCALE), **FUZZ_SETTINGS)
@given(data=st.data(), writer=st.booleans(), summarize=st.booleans())
def test_fuzz_pipeline_on_loaded_transcripts(
    data: st.DataObject, writer: bool, summarize: bool
) -> None:
    """Whatever load_transcript(strict=False) accepts goes through the pipeline and to_api."""
    lines = data.draw(jsonl_files(PIPELINE_OPTS, long_sessions=True), label="lines")
    tmp, base = make_sandbox()
    with tmp:
        path = base / "input.jsonl"
        write_lines(path, lines)
        with watchdog():
            loaded = load_transcript(path, strict=False)
        event(f"loaded messages: {min(len(loaded.messages), 5)}")
        try:
            _, _, ctx = run_default_pipeline(
                loaded.messages,
                base,
                writer=writer,
                summarizer=EchoSummarizer() if summarize else None,
                passes=2,
            )
        except Exception as exc:
            cause = exc.__cause__ if isinstance(exc, StageError) else None
            raise AssertionError(
                f"accepted transcript crashed the pipeline: {type(exc).__name__}: {exc!s:.500}"
                + (f" (cause {type(cause).__name__})" if cause else "")
            ) from exc
        event(f"persisted: {bool(ctx.report.persisted or ctx.replacement_state.replacements)}")
        assert_contained(Path(tmp.name), base, ctx, {path, base / "transcript.jsonl"})


# -- directly built hostile messages ----------------------------------------------------------

HOSTILE_IDS = (
    "../../etc/passwd",
    "../../../../../../../../x",
    "/etc/passwd",
    "",
    ".",
    "..",
    "x" * 10_240,
    "a\x00b",
    "\x00",
    "toolu_01",
    "toolu_01",  # duplicates on purpose
    "a/b\\c",
    "CON",
    "id with spaces",
    "\u202eevil",
    "🙂",
    "a" * 128,
    "a" * 129,
    "\udcff",
    "\ud800x",
    "unsafe." + "0" * 64,
    "-",
    "_",
)


@functools.cache
def hostile_ids() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(HOSTILE_IDS), st.text(max_size=12))


@functools.cache
def odd_blocks() -> st.SearchStrategy[Any]:
    """Items of a tool_result's content list: blocks missing keys, odd types, nested lists."""
    leaf = st.one_of(
        st.just({}),
        st.just({"type": "text"}),
        st.just({"type": "text", "text": None}),
        st.just({"type": "text", "text": 5}),
        st.just({"type": None}),
        st.just({"type": 5}),
        st.just({"text": "no type"}),
        st.just({"type": "tool_result"}),
        st.just({"type": "tool_use", "id": "toolu_01"}),
        st.just({"type": "document", "source": {"type": "text", "data": "doc"}}),
        st.just({"type": "document"}),
        st.just({"type": "💥", "x": [[[]]]}),
        st.just({"type": "thinking"}),
        st.just({"type": "redacted_thinking", "data": None}),
        st.builds(
            lambda t: {"type": "text", "text": t},
            st.one_of(st.text(max_size=20), st.sampled_from(UNICODE_SAMPLES + SURROGATE_SAMPLES)),
        ),
        image_blocks(),
        st.integers(),
        st.none(),
        st.text(max_size=5),
    )
    nested_lists = st.lists(st.one_of(leaf, st.lists(leaf, max_size=2)), min_size=1, max_size=3)
    return st.one_of(leaf, nested_lists)


@functools.cache
def result_contents() -> st.SearchStrategy[Any]:
    big = st.builds(
        huge,
        st.sampled_from(("x", "line\n", "🙂", "\x00", "\udcff", "a\ud800")),
        st.sampled_from((50_001, 300_000, 1_000_000)),
    )
    return st.one_of(
        st.none(),
        st.just(""),
        st.just(" \n\t "),
        st.text(max_size=50),
        big,
        st.builds(lambda t: [{"type": "text", "text": t}], big),
        st.builds(lambda t: [{"type": "text", "text": t}, {"type": "text", "text": t}], big),
        st.builds(
            lambda t: [
                {"type": "text", "text": t},
                {"type": "image", "source": {"type": "base64", "data": IMAGE_DATA[0]}},
            ],
            big,
        ),
        st.lists(odd_blocks(), max_size=4),
        st.just({"type": "text", "text": "a dict, not a list"}),
        st.integers(),
        st.just(b"bytes"),
        st.just("<persisted-output>\nfake\n</persisted-output>"),
        st.just("[Old tool result content cleared]"),
        st.builds(
            lambda d: [[[{"type": "text", "text": "x" * d}]]], st.sampled_from([10, 300_000])
        ),
    )


@st.composite
def tool_result_block(draw: st.DrawFn, tid: str | None, *, long: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_result"}
    how = draw(st.sampled_from(["id"] * (30 if long else 6) + ["missing", "int", "none", "list"]))
    if how == "id" and tid is not None:
        block["tool_use_id"] = tid
    elif how == "int":
        block["tool_use_id"] = 5
    elif how == "none":
        block["tool_use_id"] = None
    elif how == "list":
        block["tool_use_id"] = [tid]
    if draw(st.integers(0, 29 if long else 7)):
        block["content"] = draw(
            rare(LONG_RESULTS, result_contents(), one_in=4) if long else result_contents()
        )
    if draw(st.booleans()):
        block["is_error"] = draw(st.one_of(st.booleans(), st.just("yes"), st.none()))
    if draw(st.integers(0, 5)) == 0:
        block["cache_control"] = {"type": "ephemeral"}
    return block


def deep_list(depth: int) -> list[Any]:
    """``depth`` nested lists, built without recursion."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


DIRECT_DEPTHS = (1, 50, SAFE_DEPTH, 5_000)
"""Nesting of tool_use inputs built directly (5,000 is past any recursion limit here)."""

LONG_RESULTS = st.builds(
    huge, st.sampled_from(("word ", "line\n", "🙂 ")), st.sampled_from((10_000, 30_000, 45_000))
)
"""Results of a long session: under the per-tool limits, large enough to be worth clearing."""
ANY_TOOL_NAME = st.one_of(st.sampled_from(TOOL_NAMES), st.integers(), st.none())


@st.composite
def tool_use_block(draw: st.DrawFn, tid: str, *, long: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_use"}
    if draw(st.integers(0, 29 if long else 9)):
        block["id"] = tid
    if draw(st.integers(0, 9)):
        compactable = st.sampled_from(("Bash", "Read", "Grep"))
        block["name"] = draw(rare(compactable, ANY_TOOL_NAME, one_in=5) if long else ANY_TOOL_NAME)
    if draw(st.integers(0, 9)):
        block["input"] = draw(
            st.one_of(
                st.just({"command": "ls"}),
                st.just({"a": [[[[{"b": None}]]]], "n": float("nan"), "big": 10**100}),
                st.just(b"bytes"),
                st.just({1, 2}),
                st.just("not a dict"),
                st.just(None),
                st.builds(deep_list, st.sampled_from(DIRECT_DEPTHS)),
            )
        )
    return block


@functools.cache
def other_blocks() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(
            lambda t: {"type": "text", "text": t},
            st.one_of(st.text(max_size=30), st.sampled_from(UNICODE_SAMPLES + SURROGATE_SAMPLES)),
        ),
        st.just({"type": "text"}),
        st.just({}),
        st.just({"type": None}),
        st.just({"type": "thinking", "thinking": "hmm"}),
        st.just({"type": "server_tool_use", "id": "srv_1", "input": {}}),
        st.just({"type": "document", "source": {"type": "base64", "data": "JVBERi0="}}),
        image_blocks(),
    )


@functools.cache
def maybe_usage() -> st.SearchStrategy[Usage | None]:
    big = [170_000, 10**9, MAX_TOKENS]  # past MAX_TOKENS a Usage refuses to exist
    n = st.one_of(st.integers(0, 200_000), st.sampled_from(big))
    return st.one_of(
        st.none(), st.builds(Usage, input_tokens=n, output_tokens=n, cache_read_input_tokens=n)
    )


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    """A hostile but well-typed conversation: every content list holds dicts.

    One in three is a long session (10-14 tool turns on a clock, mostly distinct ids of
    compactable tools, a large usage at the end, sometimes an idle gap before the last
    prompt) so that microcompact, history snip and autocompact act on hostile content too.
    """
    long = draw(st.integers(0, 2)) == 0
    pool = draw(st.lists(hostile_ids(), min_size=1, max_size=6))
    uuid_text = st.sampled_from(["u", "🙂", "\u202e", "../x", "\x00", "", "\ud800", "\udcff"])
    counter = iter(range(10**6))
    minute = 0
    used: set[str] = set()

    def uid() -> str:
        return f"m{next(counter)}{draw(uuid_text)}" if draw(st.integers(0, 19)) else "dup-uuid"

    def common() -> dict[str, Any]:
        nonlocal minute
        minute += 1
        stamp = clock(minute) if long else draw(timestamps())
        kw: dict[str, Any] = {"uuid": uid(), "timestamp": stamp}
        if draw(st.integers(0, 9)) == 0:
            kw["is_meta"] = True
        if draw(st.integers(0, 19)) == 0:
            kw["is_sidechain"] = True
        return kw

    msgs: list[Message] = [
        Message.user(
            draw(st.one_of(st.text(max_size=30), st.lists(other_blocks(), max_size=3))), **common()
        )
    ]
    turns = draw(st.integers(10, 14)) if long else draw(st.integers(1, 6))
    for turn in range(turns):
        if long:
            # hostile ids too, but each at most once: an id reused across turns ties them into
            # one round, and the stages that cut between rounds would have nothing to do
            ids = []
            for k in range(draw(st.integers(1, 3))):
                tid = draw(rare(st.just(f"toolu_{turn}_{k}"), st.sampled_from(pool), one_in=8))
                ids.append(f"toolu_{turn}_{k}" if tid in used else tid)
                used.add(tid)
            usage = (
                Usage(input_tokens=draw(st.sampled_from([150_000, 165_000, 175_000, 190_000])))
                if turn == turns - 1
                else draw(rare(st.none(), maybe_usage(), one_in=4))
            )
        else:
            ids = [draw(st.sampled_from(pool)) for _ in range(draw(st.integers(0, 3)))]
            usage = draw(maybe_usage())
        blocks = [draw(tool_use_block(i, long=long)) for i in ids]
        blocks += draw(st.lists(other_blocks(), max_size=1 if long else 2))
        blocks = list(draw(st.permutations(blocks)))
        msgs.append(
            Message.assistant(
                blocks,
                message_id=f"msg_{turn}"
                if long
                else draw(st.sampled_from(["msg_a", "msg_b", "msg_c", None, "msg_🙂"])),
                usage=usage,
                model=draw(st.sampled_from(["claude-opus-4-6", "<synthetic>", None, "x"])),
                **common(),
            )
        )
        answer = [i for i in ids if draw(st.integers(0, 5))] + draw(
            st.lists(st.sampled_from(pool), max_size=0 if long else 1)
        )
        results = [draw(tool_result_block(i, long=long)) for i in answer]
        if long:
            minute += 9
        cut = draw(st.integers(0, len(results)))
        for part in (results[:cut], results[cut:]):
            if part or draw(st.booleans()):
                extra = (
                    draw(st.lists(other_blocks(), max_size=1))
                    if draw(st.integers(0, 3)) == 0
                    else []
                )
                msgs.append(Message.user([*part, *extra], **common()))
            noise = draw(
                st.sampled_from(
                    ["none"] * (12 if long else 6)
                    + ["progress", "system", "attachment", "local"]
                    # a compaction restart makes a long session short again: rare there
                    + ([] if long else ["boundary", "summary"])
                )
            )
            if noise == "progress":
                msgs.append(Message(type="progress", **common()))
            elif noise == "system":
                msgs.append(
                    Message(
                        type="system",
                        content=draw(st.text(max_size=10)),
                        subtype="info",
                        **common(),
                    )
                )
            elif noise == "attachment":
                msgs.append(
                    Message(
                        type="attachment",
                        content=draw(
                            st.one_of(st.text(max_size=10), st.lists(other_blocks(), max_size=2))
                        ),
                        **common(),
                    )
                )
            elif noise == "boundary":
                msgs.append(Message(type="system", subtype="compact_boundary", **common()))
            elif noise == "local":
                msgs.append(
                    Message(
                        type="system",
                        subtype="local_command",
                        content="<stdout>x</stdout>",
                        **common(),
                    )
                )
            elif noise == "summary":
                msgs.append(Message.user("summary so far", is_compact_summary=True, **common()))
    if long:
        minute += draw(st.sampled_from([0, 120]))
    if long or draw(st.booleans()):
        msgs.append(Message.user(draw(st.text(max_size=20)) or "next", **common()))
    if draw(st.integers(0, 19)) == 0:  # an item that is not a block: a clear ValueError
        lists = [i for i, m in enumerate(msgs) if isinstance(m.content, list)]
        if lists:
            i = draw(st.sampled_from(lists))
            junk = draw(st.sampled_from(["junk", 5, None, ["nested"]]))
            msgs[i] = msgs[i].with_content([*msgs[i].content, junk])
    event(f"long conversation: {long}")
    return msgs


def check_clean_failure(exc: BaseException) -> str:
    """A refusal the contract allows, or re-raise as a failure naming the crash."""
    if isinstance(exc, Hang):
        raise exc
    if isinstance(exc, StageError):
        cause = exc.__cause__
        assert re.match(r"stage '[^']+' ", str(exc)), str(exc)
        if isinstance(cause, INTERNAL_ERRORS):
            raise AssertionError(f"a stage crashed: {exc!s:.500}") from exc
        return f"StageError({type(cause).__name__})"
    if isinstance(exc, ValueError | TypeError) and not isinstance(exc, UnicodeError):
        assert str(exc), f"{type(exc).__name__} without a message"
        return type(exc).__name__
    raise AssertionError(f"{type(exc).__name__} escaped: {exc!s:.500}") from exc


@pytest.mark.slow
@settings(max_examples=round(PIPELINE_BUILT_EXAMPLES * SCALE), **FUZZ_SETTINGS)
@given(messages=conversations(), writer=st.booleans(), summarize=st.booleans())
def test_fuzz_pipeline_on_built_messages(
    messages: list[Message], writer: bool, summarize: bool
) -> None:
    """Hostile-but-typed messages: success or a clear refusal, and nothing outside the store."""
    tmp, base = make_sandbox()
    with tmp:
        ctx = new_context(base, writer=writer)
        try:
            run_default_pipeline(
                messages,
                base,
                writer=writer,
                summarizer=EchoSummarizer() if summarize else None,
                ctx=ctx,
            )
            event("outcome: ok")
        except Exception as exc:
            event(f"outcome: {check_clean_failure(exc)}")
        assert_contained(Path(tmp.name), base, ctx, {base / "transcript.jsonl"})


def test_pipeline_traversal_ids_stay_in_the_store(tmp_path: Path) -> None:
    """Path-like, empty, NUL and 10 KB ids all land in tool-results as safe names."""
    ids = [
        "../../etc/passwd",
        "../../../../../../../../x",
        "/etc/passwd",
        "",
        "a\x00b",
        "x" * 10_240,
        "..",
    ]
    msgs = [
        Message.user("go"),
        Message.assistant(
            [{"type": "tool_use", "id": i, "name": "Bash", "input": {}} for i in ids],
            message_id="m1",
        ),
        Message.user(
            [{"type": "tool_result", "tool_use_id": i, "content": huge("x", 300_000)} for i in ids]
        ),
    ]
    tmp, base = make_sandbox()
    with tmp:
        _, wires, ctx = run_default_pipeline(msgs, base, writer=True)
        assert len(ctx.report.persisted) == len(ids)
        assert_contained(Path(tmp.name), base, ctx, {base / "transcript.jsonl"})
        results = wires[0][-1]["content"]
        assert all(b["content"].startswith("<persisted-output>") for b in results)


# ---------------------------------------------------------------------------------------------
# What this file found: minimal reproducers
# ---------------------------------------------------------------------------------------------
# Fixed in the working tree while this file was written: plain regression tests.


def _load_lines(tmp_path: Path, *recs: bytes) -> Any:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(recs) + b"\n")
    return load_transcript(path, strict=False)


_PROMPT = b'{"type":"user","uuid":"p","message":{"role":"user","content":"hi"}}'
_BASH = (
    b'{"type":"assistant","uuid":"a","message":{"id":"m1","model":"claude-opus-4-6",'
    b'"content":[{"type":"tool_use","id":"t1","name":"Bash","input":{}}]}}'
)


def test_found_escaped_surrogate_in_persisted_result_with_transcript(tmp_path: Path) -> None:
    """Was: TranscriptWriter encoded with surrogateescape only, so a JSON-escaped \\ud800 in a
    persisted result's preview made append_replacements raise UnicodeEncodeError (StageError
    from tool_result_budget)."""
    big = (
        b'{"type":"user","uuid":"r","message":{"role":"user","content":[{"type":"tool_result",'
        b'"tool_use_id":"t1","content":"\\ud800' + b"x" * 300_000 + b'"}]}}'
    )
    loaded = _load_lines(tmp_path, _PROMPT, _BASH, big)
    assert not loaded.problems
    tmp, base = make_sandbox()
    with tmp:
        _, _, ctx = run_default_pipeline(loaded.messages, base, writer=True)
        assert ctx.report.persisted
        reloaded = load_transcript(base / "transcript.jsonl")
        assert [r.replacement for r in reloaded.replacement_records] == list(
            ctx.replacement_state.replacements.values()
        )


def test_found_surrogate_uuid_through_history_snip(tmp_path: Path) -> None:
    """Was: history_snip's marker uuid came from uuid.uuid5(), which refuses lone surrogates
    (a uuid read from invalid UTF-8): StageError(UnicodeEncodeError) from history_snip."""
    recs = [b'{"type":"user","uuid":"p\xff","message":{"role":"user","content":"hi"}}']
    for r in range(12):
        tokens = 170_000 if r == 11 else 10
        recs.append(
            b'{"type":"assistant","uuid":"a%d\xff","message":{"id":"m%d","model":"claude-opus-4-6",'
            b'"content":[{"type":"text","text":"ok"}],"usage":{"input_tokens":%d}}}'
            % (r, r, tokens)
        )
        recs.append(
            b'{"type":"user","uuid":"u%d\xff","message":{"role":"user","content":"next"}}' % r
        )
    loaded = _load_lines(tmp_path, *recs)
    assert not loaded.problems
    tmp, base = make_sandbox()
    with tmp:
        _, _, ctx = run_default_pipeline(loaded.messages, base, writer=False)
        assert ctx.report.decisions["history_snip"].facts[ATTR.REMOVED_TOTAL]


def test_found_huge_usage_line_is_a_clear_error(tmp_path: Path) -> None:
    """Was: usage counts past 1.8e308 loaded and made the calibrated estimate raise
    OverflowError out of Pipeline.run. Now the loader refuses counts above MAX_TOKENS."""
    rec = (
        b'{"type":"assistant","uuid":"a","message":{"id":"m1","model":"claude-opus-4-6",'
        b'"content":[{"type":"text","text":"x"}],"usage":{"output_tokens":1' + b"0" * 309 + b"}}}"
    )
    loaded = _load_lines(tmp_path, _PROMPT, rec)
    assert [p.line for p in loaded.problems] == [2]
    assert "usage.output_tokens" in loaded.problems[0].reason
    tmp, base = make_sandbox()
    with tmp:
        run_default_pipeline(loaded.messages, base, writer=False)


def test_found_deepest_accepted_nesting_goes_through_the_pipeline(tmp_path: Path) -> None:
    """Was: the loader accepted nesting right under the recursion limit and the token
    estimate's json.dumps, deeper in the stack, raised RecursionError out of Pipeline.run.
    Now the loader refuses records nested deeper than MAX_NESTING."""

    def make(depth: int) -> bytes:
        block = {"type": "tool_use", "id": "t1", "name": "Bash", "input": nested(depth)}
        msg = {"id": "m1", "model": "claude-opus-4-6", "content": [block]}
        return dump({"type": "assistant", "uuid": "a", "message": msg})

    lo, hi = 1, 20_000  # the deepest input the loader accepts, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _load_lines(tmp_path, make(mid)).messages else (lo, mid - 1)
    assert lo < MAX_NESTING
    loaded = _load_lines(tmp_path, make(lo))
    tmp, base = make_sandbox()
    with tmp:
        run_default_pipeline(loaded.messages, base, writer=False)


def test_found_bare_cr_is_whitespace_not_a_line_break(tmp_path: Path) -> None:
    """Was: universal newlines split a record at a bare CR (JSON whitespace) and shifted every
    later line number."""
    loaded = _load_lines(
        tmp_path,
        b'{"type":"user",\r"uuid":"a","message":{"role":"user","content":"hi"}}',
        b"{bad",
    )
    assert [m.uuid for m in loaded.messages] == ["a"]
    assert [p.line for p in loaded.problems] == [2]


def test_found_skipped_replacement_line_keeps_no_records(tmp_path: Path) -> None:
    """Was: a content-replacement line's leading valid entries stayed although the line was
    reported as skipped."""
    loaded = _load_lines(
        tmp_path,
        b'{"type":"content-replacement","replacements":[{"tool_use_id":"t1","replacement":"R"},5]}',
    )
    assert [p.line for p in loaded.problems] == [1]
    assert loaded.replacement_records == []


def test_found_skipped_line_does_not_name_the_session(tmp_path: Path) -> None:
    """Was: sessionId was read before the record was validated, so a skipped line decided
    Transcript.session_id (which Agent.resume uses)."""
    loaded = _load_lines(
        tmp_path,
        b'{"type":"user","sessionId":"evil","uuid":"x"}',
        b'{"type":"user","sessionId":"good","uuid":"u","message":{"role":"user","content":"hi"}}',
    )
    assert [p.line for p in loaded.problems] == [1]
    assert loaded.session_id == "good"


def test_found_non_block_item_is_a_clear_error(tmp_path: Path) -> None:
    """Was: a non-dict item in a content list reached b.get() in rounds.safe_cuts (StageError
    wrapping AttributeError from history_snip) and in to_api (a bare AttributeError)."""
    msgs = [
        Message.user("hi"),
        Message.assistant(
            [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}], message_id="m1"
        ),
        Message.user([{"type": "tool_result", "tool_use_id": "t1", "content": "x"}, "junk"]),  # type: ignore[list-item]
    ]
    tmp, base = make_sandbox()
    with tmp, pytest.raises((StageError, ValueError, TypeError)) as info:
        run_default_pipeline(msgs, base, writer=False)
    check_clean_failure(info.value)
    assert "content item 1" in str(info.value)


def test_found_microcompact_reapply_keeps_freed_tokens(tmp_path: Path) -> None:
    """Was: microcompact added to ctx.report.tokens_freed only in the pass that cleared; a pass
    re-applying the same clears against the same usage anchor (a retried call) freed nothing,
    the estimate jumped back by the cleared amount and autocompact compacted: identical input,
    a one-message request instead of 17 messages."""
    msgs = [Message.user("start")]
    for r in range(8):
        use = {"type": "tool_use", "id": f"t{r}", "name": "Bash", "input": {"command": "ls"}}
        usage = Usage(input_tokens=170_000) if r == 7 else None
        msgs.append(Message.assistant([use], message_id=f"m{r}", usage=usage, model="claude-x"))
        result = {"type": "tool_result", "tool_use_id": f"t{r}", "content": "word " * 8000}
        msgs.append(Message.user([result]))
    msgs.append(Message.user("next"))
    tmp, base = make_sandbox()
    with tmp:
        _, wires, ctx = run_default_pipeline(
            msgs, base, writer=False, summarizer=EchoSummarizer(), passes=2
        )
        assert ctx.report.decisions["microcompact"].decision == "reapply"
        assert wires[1] == wires[0]


def test_found_huge_usage_built_directly_is_refused() -> None:
    """A ``Usage`` is bounded like a loaded one: a count float arithmetic cannot hold is a
    ValueError naming the field, at construction (it once overflowed the estimate)."""
    with pytest.raises(ValueError, match=r"usage\.output_tokens must be an integer"):
        Usage(output_tokens=10**309)
    with pytest.raises(ValueError, match=r"usage\.input_tokens"):
        Usage(input_tokens=-1)
    assert Usage(output_tokens=MAX_TOKENS).output_tokens == MAX_TOKENS


def test_found_deep_nesting_built_directly_is_a_clear_error(tmp_path: Path) -> None:
    """A tool_use input built past the recursion limit: a ValueError naming the record, from
    the first stage that measures it (it once escaped ``Pipeline.run`` as a RecursionError)."""
    use = {"type": "tool_use", "id": "t1", "name": "Bash", "input": deep_list(5_000)}
    msgs = [Message.user("hi"), Message.assistant([use], message_id="m1", uuid="deep")]
    tmp, base = make_sandbox()
    with tmp, pytest.raises(StageError, match="'deep': a content block is nested too deeply") as e:
        run_default_pipeline(msgs, base, writer=False)
    assert isinstance(e.value.__cause__, ValueError)
