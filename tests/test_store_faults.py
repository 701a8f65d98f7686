"""A fault at every step of a persist, on the real ``FileToolResultStore`` and the real disk.

A persist of ``FileToolResultStore`` takes these steps, and each test here makes exactly one of
them fail through the store's ``file_ops`` seam (one ``FileOps`` per persist, so a fault is
aimed at one tool_use_id and nothing else; see :class:`Injector`):

======================  ===================  ===============================================
step                    file operation       what the store promises after it fails
======================  ===================  ===============================================
``makedirs_root``       ``os.makedirs``      no final file, no temp file (none was created)
``mkdir_session``       ``os.mkdir``         no final file, no temp file (none was created)
``mkdir_tool_results``  ``os.mkdir``         no final file, no temp file (none was created)
``lstat_target``        ``os.lstat``         no final file, no temp file (none was created)
``open_tmp``            ``os.open``          no final file, no temp file (the create failed)
``write_first``         ``os.write``         no final file, the partial temp is unlinked
``write_half_enospc``   ``os.write``         half written, then ENOSPC: as ``write_first``
``fsync``               ``os.fsync``         no final file, the unsynced temp is unlinked
``close``               ``os.close``         no final file, the temp is unlinked (see below)
``link``                ``os.link``          no final file, the complete temp is unlinked
``unlink_tmp``          ``os.unlink``        the link DID happen: the final file exists and is
                                             complete and byte-exact; its temp (a second hard
                                             link to the same inode) stays behind, since the
                                             call that would remove it is the one that failed
======================  ===================  ===============================================

``close`` follows Linux close(2): the descriptor is released even when close reports an error
(EIO on write-back), so the fake closes the real descriptor and then raises; the store must not
retry the close (a double close could hit a descriptor another thread just got).

For every step the tests run a full pipeline turn (``Pipeline([ToolResultBudget(limit)])``,
through the per-message budget and through the per-tool gate, and the agent loop's
``gate_tool_result`` followed by the stage) and check:

1. the turn completes and the result whose write failed is sent with its ORIGINAL content,
   byte for byte in the ``to_api`` request; a parallel result in the same turn is persisted
   normally (a fault is confined to its own id);
2. ``ctx.report.persist_failed`` names the id and a ``tool_result_budget.decision`` span
   records ``persist_failed`` with the error type, the reason and no path;
3. no file under the final name -- except ``unlink_tmp``, where the final file is complete;
4. no temp file left behind (``unlink_tmp``: exactly one, a hard link of the final file), and
   no descriptor of the store left open (Linux, via ``/proc/self/fd``);
5. with the fault removed, later turns follow the frozen-decision rule: the failed id is never
   offered to the store again (no decision span, no file appears), stays original byte for byte
   (the request prefix the model saw never changes, also after a resume from the transcript),
   and a NEW large result is persisted normally.

A seeded random test then aims a random fault (step and errno among ENOSPC, EACCES, EIO, EROFS,
EDQUOT) at every persist of multi-result turns (parallel results) and checks the same for every
id: :data:`RANDOM_FAULTS_INJECTED` faults over :data:`RANDOM_FAULTED_TURNS` faulted turns
(:data:`RANDOM_TURNS` turns with the clean ones), each fault counted as it fires.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pipeline import (
    FileToolResultStore,
    Message,
    Pipeline,
    SessionContext,
    ToolPolicies,
    TranscriptWriter,
    load_transcript,
    to_api,
)
from pipeline.gate import gate_tool_result
from pipeline.replacement import ReplacementState
from pipeline.results.keys import PERSISTED_OUTPUT_TAG
from pipeline.store.files import OsFileOps
from pipeline.testing import QuietLogger, SpanRecorder
from pipeline.tracing import ATTR
from stages import ToolResultBudget
from tests.builders import assistant, ids, key, results, tool_result, tool_use, user_text

SESSION = "sess-faults"
TOOL = "Glob"

# --------------------------------------------------------------------------------------------
# The steps of a persist and the fault injector
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    func: str
    """The file operation (``FileOps`` method) that fails at this step."""
    default_errno: int
    """The errno the deterministic test raises (a realistic one for the call)."""
    after_link: bool = False
    """The fault comes after the final name exists: the final file stays, complete."""


STEPS: dict[str, Step] = {
    "makedirs_root": Step("makedirs", errno.EACCES),
    "mkdir_session": Step("mkdir", errno.EROFS),
    "mkdir_tool_results": Step("mkdir", errno.EDQUOT),
    "lstat_target": Step("lstat", errno.EIO),
    "open_tmp": Step("open", errno.EACCES),
    "write_first": Step("write", errno.EIO),
    "write_half_enospc": Step("write", errno.ENOSPC),
    "fsync": Step("fsync", errno.EIO),
    "close": Step("close", errno.EIO),
    "link": Step("link", errno.EPERM),  # e.g. a file system without hard links
    "unlink_tmp": Step("unlink", errno.EIO, after_link=True),
}
RANDOM_ERRNOS = (errno.ENOSPC, errno.EACCES, errno.EIO, errno.EROFS, errno.EDQUOT)


def _stem(target: Path) -> str:
    return target.name.rsplit(".", 1)[0]


def _error(err: int, what: str) -> OSError:
    # OSError(errno, ...) picks the subclass for the errno (EACCES -> PermissionError)
    return OSError(err, f"{os.strerror(err)} (injected: {what})")


def error_name(err: int) -> str:
    return type(_error(err, "")).__name__


@dataclass(frozen=True)
class Fault:
    step: str
    err: int


class FaultyOps(OsFileOps):
    """The real file operations of one persist, but for the one step its fault is aimed at."""

    def __init__(self, injector: Injector, fault: Fault, target: Path) -> None:
        self.injector, self.fault, self.target = injector, fault, target
        self.written = False

    def _fire(self) -> None:
        tid, step = _stem(self.target), self.fault.step
        self.injector.fired.append((tid, step))
        raise _error(self.fault.err, f"{step} of {tid}")

    def _at(self, step: str) -> bool:
        return self.fault.step == step

    def makedirs(self, path: Path, mode: int) -> None:
        if self._at("makedirs_root") and path == self.injector.store.root:
            self._fire()
        super().makedirs(path, mode)

    def mkdir(self, path: Path, mode: int) -> None:
        store = self.injector.store
        if (self._at("mkdir_session") and path == store.root / store.session_id) or (
            self._at("mkdir_tool_results") and path == store.directory
        ):
            self._fire()
        super().mkdir(path, mode)

    def lstat(self, path: Path) -> os.stat_result:
        if self._at("lstat_target") and path == self.target:
            self._fire()
        return super().lstat(path)

    def open(self, path: Path, flags: int, mode: int) -> int:
        if self._at("open_tmp"):
            self._fire()
        return super().open(path, flags, mode)

    def write(self, fd: int, data: memoryview) -> int:
        if self._at("write_half_enospc") and not self.written and len(data) > 1:
            self.written = True  # a short write first, as a filling disk gives
            return super().write(fd, data[: len(data) // 2])
        if self._at("write_first") or self._at("write_half_enospc"):
            self._fire()
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        if self._at("fsync"):
            self._fire()
        super().fsync(fd)

    def close(self, fd: int) -> None:
        super().close(fd)  # Linux: the descriptor is gone even when close fails
        if self._at("close"):
            self._fire()

    def link(self, src: Path, dst: Path) -> None:
        if self._at("link"):
            self._fire()
        super().link(src, dst)

    def unlink(self, path: Path) -> None:
        if self._at("unlink_tmp") and path.name.startswith(".tmp-"):
            self._fire()
        super().unlink(path)


_REAL = OsFileOps()


@dataclass
class Injector:
    """The store's file operations (``FileToolResultStore(file_ops=injector.ops)``), with the
    faults of the active plan aimed by tool_use_id: while a plan is active, the persist of a
    planned id fails at its step, on every attempt; every other persist, and everything
    outside the store, meets the real file system. ``fired`` lists each firing, as (id, step).
    """

    store: FileToolResultStore = field(init=False)
    plan: dict[str, Fault] = field(default_factory=dict)
    fired: list[tuple[str, str]] = field(default_factory=list)

    def ops(self, target: Path) -> OsFileOps:
        fault = self.plan.get(_stem(target))
        return _REAL if fault is None else FaultyOps(self, fault, target)

    @contextmanager
    def active(self, plan: dict[str, Fault]) -> Iterator[Injector]:
        self.plan, self.fired = plan, []
        try:
            yield self
        finally:
            self.plan = {}


# --------------------------------------------------------------------------------------------
# Session, history and checks
# --------------------------------------------------------------------------------------------


PATHS = {
    # path: (per-message limit, per-tool cap, decision reason)
    "per_message": (3_000, 1_000_000, "per_message"),
    "per_tool": (1_000_000, 1_000, "per_tool"),
}


@dataclass
class Session:
    root: Path
    store: FileToolResultStore
    faults: Injector
    ctx: SessionContext
    spans: SpanRecorder
    logger: QuietLogger
    pipe: Pipeline
    transcript_path: Path
    reason: str

    def decisions(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for attrs in self.spans.decision_attributes("tool_result_budget"):
            if ATTR.TOOL_CALL_ID not in attrs:
                continue  # a pass's decision (nothing fresh), not one on a result
            out.setdefault(str(attrs[ATTR.TOOL_CALL_ID]), []).append(dict(attrs))
        return out


def new_session(tmp_path: Path, path: str, session_id: str = SESSION) -> Session:
    limit, cap, reason = PATHS[path]
    spans = SpanRecorder()
    root = tmp_path / "store"
    faults = Injector()
    store = FileToolResultStore(root, session_id, file_ops=faults.ops)
    faults.store = store
    transcript_path = tmp_path / f"{session_id}.jsonl"  # outside the store: never faulted
    logger = QuietLogger()
    ctx = SessionContext(
        session_id,
        root,
        store=store,
        transcript=TranscriptWriter(transcript_path, session_id),
        tool_policies=ToolPolicies(cap=cap),
        tracer=spans.tracer,
        logger=logger,
    )
    return Session(
        root,
        store,
        faults,
        ctx,
        spans,
        logger,
        Pipeline([ToolResultBudget(limit)]),
        transcript_path,
        reason,
    )


def big_text(tid: str, n: int) -> str:
    """``n`` characters, multi-byte UTF-8 included, different for every id."""
    line = f"{tid}: zwei — ü 字 😀 {'x' * (len(tid) % 7)}\n"
    return (line * (n // len(line) + 1))[:n]


def big_blocks(tid: str, n: int) -> list[dict[str, Any]]:
    """A text-block list (persisted as ``.json``) of ``n`` characters."""
    head = big_text(tid, n - n // 3)
    return [{"type": "text", "text": head}, {"type": "text", "text": "." * (n - len(head))}]


def stored_bytes(content: Any) -> tuple[str, bytes]:
    """The extension and exact bytes the store writes for ``content``."""
    if isinstance(content, str):
        return "txt", content.encode("utf-8")
    return "json", json.dumps(content, indent=2, ensure_ascii=False).encode("utf-8")


def parallel_turn(mid: str, contents: dict[str, Any]) -> list[Message]:
    """One response with parallel tool calls, then one user record per result."""
    return [
        assistant(mid, *(tool_use(t, TOOL) for t in contents)),
        *(results(tool_result(t, c)) for t, c in contents.items()),
    ]


def api_results(request: list[Any]) -> dict[str, Any]:
    """tool_use_id -> the content of its tool_result block in a ``to_api`` request."""
    out: dict[str, Any] = {}
    for m in request:
        if m["role"] == "user" and isinstance(m["content"], list):
            for b in m["content"]:
                if b.get("type") == "tool_result":
                    out[b["tool_use_id"]] = b["content"]
    return out


def temps_of(store: FileToolResultStore, tid: str) -> list[Path]:
    if not store.directory.is_dir():
        return []
    pat = re.compile(r"\.tmp-[0-9a-f]{16}-" + re.escape(tid) + r"\.(txt|json)")
    return sorted(p for p in store.directory.iterdir() if pat.fullmatch(p.name))


def finals_of(store: FileToolResultStore, tid: str) -> list[Path]:
    return [p for ext in ("txt", "json") if (p := store.path_for(tid, ext)).exists()]


def open_store_fds(root: Path) -> list[str]:
    """Descriptors of this process open on anything under ``root`` (Linux; else none known)."""
    proc = Path("/proc/self/fd")
    if not proc.is_dir():
        return []
    prefix = os.path.realpath(root) + os.sep
    out: list[str] = []
    for fd in os.listdir(proc):
        try:
            dest = os.readlink(proc / fd)
        except OSError:
            continue
        if dest.startswith(prefix):
            out.append(dest)
    return out


def check_failed(s: Session, tid: str, content: Any, fault: Fault, sent: dict[str, Any]) -> None:
    """Invariants 1-4 for an id whose persist just failed in this pass."""
    assert sent[tid] == content, f"{tid}: not sent with its original content"
    assert tid in s.ctx.report.persist_failed
    assert tid not in ids(s.ctx.replacement_state.replacements)
    assert s.ctx.replacement_state.classify(key(tid, content)) == "frozen"
    (span,) = s.decisions()[tid]
    assert span[ATTR.DECISION] == "persist_failed"
    # the errno name tells the failures apart (ENOSPC is not EROFS)
    assert span[ATTR.ERROR].startswith(f"{error_name(fault.err)}: {errno.errorcode[fault.err]} (")
    assert span[ATTR.REASON] == s.reason
    assert ATTR.PATH not in span
    assert any(
        level == "warning"
        and kw.get("tool_use_id") == tid
        and kw.get("decision") == "persist_failed"
        for level, _event, kw in s.logger.events
    )
    ext, data = stored_bytes(content)
    if STEPS[fault.step].after_link:
        # the link happened before the failing unlink: a complete file, and its temp twin
        (final,) = finals_of(s.store, tid)
        assert final == s.store.path_for(tid, ext)
        assert final.read_bytes() == data
        (tmp,) = temps_of(s.store, tid)
        assert os.path.samefile(tmp, final)
    else:
        assert finals_of(s.store, tid) == [], f"{tid}: a file under the final name"
        assert temps_of(s.store, tid) == [], f"{tid}: a temp file left behind"


def check_persisted(
    s: Session, tid: str, content: Any, sent: dict[str, Any], *, twin: bool = False
) -> None:
    """A result persisted in this pass: replacement sent, file byte-exact, no temp file.

    ``twin``: one temp file is expected, a hard link of the final file (a failed unlink).
    """
    ext, data = stored_bytes(content)
    path = s.store.path_for(tid, ext)
    assert isinstance(sent[tid], str) and sent[tid].startswith(PERSISTED_OUTPUT_TAG)
    assert f"Full output saved to: {path.absolute()}\n" in sent[tid]
    assert path.read_bytes() == data
    if twin:
        (tmp,) = temps_of(s.store, tid)
        assert os.path.samefile(tmp, path)
    else:
        assert temps_of(s.store, tid) == []
    assert [p.tool_use_id for p in s.ctx.report.persisted].count(tid) == 1
    (span,) = s.decisions()[tid]
    assert span[ATTR.DECISION] == "persist" and span[ATTR.PATH] == str(path.absolute())


@dataclass
class Snapshot:
    """What the store holds for the failed ids, to prove a later turn never touched it."""

    entries: dict[str, tuple[tuple[str, int, bytes], ...]]

    @classmethod
    def take(cls, store: FileToolResultStore, ids: Sequence[str]) -> Snapshot:
        return cls(
            {
                tid: tuple(
                    (p.name, p.stat().st_ino, p.read_bytes())
                    for p in [*finals_of(store, tid), *temps_of(store, tid)]
                )
                for tid in ids
            }
        )


# --------------------------------------------------------------------------------------------
# One fault at every step, through the budget stage
# --------------------------------------------------------------------------------------------

STEP_PATH_PARAMS = [
    pytest.param(step, path, id=f"{path}-{step}") for path in PATHS for step in STEPS
]


@pytest.mark.anyio
@pytest.mark.parametrize(("step", "path"), STEP_PATH_PARAMS)
async def test_fault_at_every_step_of_a_persist(tmp_path: Path, step: str, path: str) -> None:
    """A fault at ``step`` for one result of a parallel turn: sent whole, frozen, reported.

    The contract per step is in the module docstring; ``unlink_tmp`` is the one step after the
    link, where the final file is complete and the temp (same inode) stays.
    """
    s = new_session(tmp_path, path)
    fault = Fault(step, STEPS[step].default_errno)
    big = big_text("t_big", 6_000)
    ok = big_blocks("t_ok", 4_500)
    history = [user_text("go"), *parallel_turn("msg_1", {"t_big": big, "t_ok": ok})]
    before = to_api(history)

    with s.faults.active({"t_big": fault}) as injector:
        out = await s.pipe.run(history, s.ctx)
        # the persist of t_big was attempted exactly once and failed at this step, once
        assert injector.fired == [("t_big", step)]
    request = to_api(out)
    sent = api_results(request)
    assert json.dumps(request)
    assert s.ctx.report.persist_failed == ["t_big"]
    check_failed(s, "t_big", big, fault, sent)
    # the parallel result of the same turn is not touched by the fault
    check_persisted(s, "t_ok", ok, sent)
    # apart from t_ok's replacement the request is the input, byte for byte
    assert request == [
        {**m, "content": [{**b, "content": sent[b["tool_use_id"]]} for b in m["content"]]}
        if m["role"] == "user"
        and isinstance(m["content"], list)
        and any(b.get("type") == "tool_result" for b in m["content"])
        else m
        for m in before
    ]
    assert open_store_fds(s.root) == []
    snapshot = Snapshot.take(s.store, ["t_big"])

    # -- the fault is gone: a later turn --------------------------------------------------
    s.spans.clear()
    new = big_text("t_new", 5_000)
    history2 = [*history, *parallel_turn("msg_2", {"t_new": new})]
    out2 = await s.pipe.run(history2, s.ctx)
    request2 = to_api(out2)
    sent2 = api_results(request2)
    assert request2[: len(request)] == request  # the prefix the model saw never changes
    assert sent2["t_big"] == big
    assert s.ctx.report.persist_failed == []
    assert [p.tool_use_id for p in s.ctx.report.persisted] == ["t_new"]
    assert set(s.decisions()) == {"t_new"}  # t_big was never offered to the store again
    check_persisted(s, "t_new", new, sent2)
    assert Snapshot.take(s.store, ["t_big"]) == snapshot
    # the transcript never recorded a replacement for the failed id
    records = load_transcript(s.transcript_path).replacement_records
    assert [r.tool_use_id for r in records] == ["t_ok", "t_new"]

    # -- a pass with nothing new, and a resume from the transcript: still original ----------
    s.spans.clear()
    out3 = await s.pipe.run(history2, s.ctx)
    assert to_api(out3) == request2
    assert s.decisions() == {}
    resumed = new_session(tmp_path, path)
    resumed.ctx.replacement_state = ReplacementState.reconstruct(history2, records)
    out4 = await resumed.pipe.run(history2, resumed.ctx)
    assert to_api(out4) == request2
    assert resumed.decisions() == {}
    assert Snapshot.take(s.store, ["t_big"]) == snapshot
    assert open_store_fds(s.root) == []


# --------------------------------------------------------------------------------------------
# The agent loop's gate, then the stage, with the fault still there
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("step", list(STEPS))
async def test_fault_at_every_step_through_the_agent_gate(tmp_path: Path, step: str) -> None:
    """``gate_tool_result`` (what the agent loop calls when a tool returns) under the fault.

    The gate sends the original block (the same object) with ``persist_failed``. The model has
    not seen the result yet, so the budget stage, seeing it fresh in the next request, may try
    again: with the fault still there it fails again and freezes the id. Except after
    ``unlink_tmp``: the gate's link left a complete final file, so the stage's persist finds it
    (same id => same content) and succeeds -- the request carries a replacement that points at
    a complete, byte-exact file.
    """
    s = new_session(tmp_path, "per_tool")
    fault = Fault(step, STEPS[step].default_errno)
    big = big_text("t_big", 6_000)
    threshold = s.ctx.tool_policies.threshold(TOOL)
    block = tool_result("t_big", big)
    with s.faults.active({"t_big": fault}) as injector:
        gated = await gate_tool_result(block, tool_name=TOOL, threshold=threshold, store=s.store)
        assert gated.decision == "persist_failed"
        assert gated.block is block and gated.path is None
        assert gated.error is not None and gated.error.startswith(error_name(fault.err) + ": ")
        assert injector.fired == [("t_big", step)]

        history = [user_text("go"), assistant("msg_1", tool_use("t_big", TOOL)), results(block)]
        out = await s.pipe.run(history, s.ctx)
    sent = api_results(to_api(out))
    if STEPS[step].after_link:
        assert injector.fired == [("t_big", step)]  # the stage found the file: no new write
        check_persisted(s, "t_big", big, sent, twin=True)  # the gate's temp stays
    else:
        assert injector.fired == [("t_big", step)] * 2
        assert s.ctx.report.persist_failed == ["t_big"]
        check_failed(s, "t_big", big, fault, sent)
    assert open_store_fds(s.root) == []

    s.spans.clear()
    new = big_text("t_new", 2_000)
    history2 = [
        *history,
        assistant("msg_2", tool_use("t_new", TOOL)),
        results(tool_result("t_new", new)),
    ]
    out2 = await s.pipe.run(history2, s.ctx)
    sent2 = api_results(to_api(out2))
    assert sent2["t_big"] == sent["t_big"]
    assert set(s.decisions()) == {"t_new"}
    check_persisted(s, "t_new", new, sent2)


# --------------------------------------------------------------------------------------------
# Random faults at every persist of multi-result turns
# --------------------------------------------------------------------------------------------

RANDOM_SESSIONS = 8
"""Seeds; even seeds go through the per-message budget, odd ones through the per-tool gate."""
RANDOM_FAULTED_TURNS_PER_SESSION = 6
RANDOM_RESULTS_PER_TURN = 5
"""Parallel results per turn; every one of them gets a fault."""
RANDOM_FAULTED_TURNS = RANDOM_SESSIONS * RANDOM_FAULTED_TURNS_PER_SESSION
RANDOM_TURNS = RANDOM_SESSIONS * (RANDOM_FAULTED_TURNS_PER_SESSION + 1)
"""With one clean turn per session, after the faulted ones."""
RANDOM_FAULTS_INJECTED = RANDOM_FAULTED_TURNS * RANDOM_RESULTS_PER_TURN
"""240 faults over 48 faulted turns (56 turns in all): each test asserts its share fired.

Per anyio backend: the tests run under asyncio and trio, so one run of the file fires 480."""

_PER_SESSION = RANDOM_FAULTED_TURNS_PER_SESSION * RANDOM_RESULTS_PER_TURN
RANDOM_PARAMS = [
    pytest.param(
        seed,
        "per_message" if seed % 2 == 0 else "per_tool",
        id=f"seed{seed}-{'per_message' if seed % 2 == 0 else 'per_tool'}-{_PER_SESSION}faults",
    )
    for seed in range(RANDOM_SESSIONS)
]


@pytest.mark.anyio
@pytest.mark.parametrize(("seed", "path"), RANDOM_PARAMS)
async def test_random_fault_in_every_persist_of_parallel_turns(
    tmp_path: Path, seed: int, path: str
) -> None:
    """Every persist of every faulted turn fails at a random step with a random errno.

    Per turn: every id is sent original, reported, has its failed-decision span, and the store
    holds what the step promises; the prefix of earlier turns never changes. Then one clean
    turn: its new results are persisted, and none of the failed ids is ever decided again.
    """
    rng = random.Random(seed)
    s = new_session(tmp_path, path, session_id=f"sess-rand-{seed}")
    history: list[Message] = [user_text("go")]
    contents: dict[str, Any] = {}
    faults: dict[str, Fault] = {}
    injected = 0
    prev_request = to_api(history)
    for turn in range(RANDOM_FAULTED_TURNS_PER_SESSION):
        ids = [f"t{turn}_{k}" for k in range(RANDOM_RESULTS_PER_TURN)]
        turn_contents: dict[str, Any] = {}
        for tid in ids:
            n = rng.randrange(3_100, 9_000)
            turn_contents[tid] = big_text(tid, n) if rng.random() < 0.7 else big_blocks(tid, n)
        plan = {tid: Fault(rng.choice(list(STEPS)), rng.choice(RANDOM_ERRNOS)) for tid in ids}
        history += parallel_turn(f"msg_{turn}", turn_contents)
        contents |= turn_contents
        faults |= plan

        s.spans.clear()
        with s.faults.active(plan) as injector:
            out = await s.pipe.run(history, s.ctx)
        # every persist of the turn was attempted once and faulted once
        assert sorted(injector.fired) == sorted((tid, f.step) for tid, f in plan.items())
        injected += len(injector.fired)
        request = to_api(out)
        assert request == to_api(history)  # every result original, all turns, byte for byte
        assert request[: len(prev_request)] == prev_request
        prev_request = request
        sent = api_results(request)
        assert sorted(s.ctx.report.persist_failed) == sorted(ids)
        assert s.ctx.report.persisted == []
        assert set(s.decisions()) == set(ids)
        for tid in ids:
            check_failed(s, tid, turn_contents[tid], plan[tid], sent)
        assert open_store_fds(s.root) == []
    assert injected == _PER_SESSION

    # -- the faults are gone: one clean turn ----------------------------------------------
    snapshot = Snapshot.take(s.store, list(faults))
    clean = {f"c_{k}": big_text(f"c_{k}", rng.randrange(3_100, 9_000)) for k in range(3)}
    history += parallel_turn("msg_clean", clean)
    s.spans.clear()
    out = await s.pipe.run(history, s.ctx)
    request = to_api(out)
    sent = api_results(request)
    assert request[: len(prev_request)] == prev_request
    for tid, content in contents.items():
        assert sent[tid] == content
    assert s.ctx.report.persist_failed == []
    assert set(s.decisions()) == set(clean)
    for tid, content in clean.items():
        check_persisted(s, tid, content, sent)
    assert Snapshot.take(s.store, list(faults)) == snapshot
    records = load_transcript(s.transcript_path).replacement_records
    assert sorted(r.tool_use_id for r in records) == sorted(clean)
    # no stray temp file of any id: only the twins of the unlink_tmp faults remain
    stray = sorted(p.name for p in s.store.directory.iterdir() if p.name.startswith(".tmp-"))
    expected = sorted(
        p.name
        for tid, f in faults.items()
        if STEPS[f.step].after_link
        for p in temps_of(s.store, tid)
    )
    assert stray == expected
    assert len(expected) == sum(STEPS[f.step].after_link for f in faults.values())
    assert open_store_fds(s.root) == []


def test_fault_counts_are_what_the_readme_quotes() -> None:
    """The constants the README quotes, and every step covered by the deterministic tests."""
    assert (RANDOM_FAULTS_INJECTED, RANDOM_FAULTED_TURNS, RANDOM_TURNS) == (240, 48, 56)
    assert len(STEP_PATH_PARAMS) == 2 * len(STEPS) == 22
    funcs = {st.func for st in STEPS.values()}
    assert funcs == {
        "makedirs",
        "mkdir",
        "lstat",
        "open",
        "write",
        "fsync",
        "close",
        "link",
        "unlink",
    }
