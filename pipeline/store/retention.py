"""Retention for long-lived stores: remove whole conversations nothing wrote to within an age,
then persisted tool results by age, then by total size.

A store that lives for weeks (the proxy's, an agent's ``.sluicegate``) only grows: every
oversized tool result of every session stays under ``<root>/<session>/tool-results/``, and a
drop-in keeps records for every conversation it ever saw. :func:`prune_store` removes the old
ones. With an age, a conversation directory whose files are all the store's and all older than
it goes whole first, records included (:mod:`pipeline.store.retention_conversations`); what follows
is about persisted results.

What it may remove is narrow on purpose: regular files directly inside a real (not symlinked)
``<root>/<session>/tool-results/`` directory (or ``<root>/<tenant>/<session>/tool-results/``,
where a drop-in keeps each tenant's conversations: :mod:`pipeline.dropin.tenancy`) whose names are
the names :class:`~pipeline.store.files.FileToolResultStore` gives persisted results (``<id>.txt``,
``<id>.json``, ``unsafe.<sha256>.<ext>``, and their ``.<12 hex>`` content-named variants).
A writer's temp file (``.tmp-*``), a transcript, ``decisions.jsonl``, a lock, anything else
anyone put there, and whatever a symlink points at are never touched. Then each
``tool-results`` directory it emptied is removed, and its session directory if that is empty
too: a session directory holding anything else stays.

Pruning is a policy decision only the user can make. A persisted file is what a replacement
in some conversation points at: the model may read it back at any later turn, for as long as
that conversation goes on (or is resumed). Once it is removed, such a read fails. Choose an
age past which no session you still use refers back (the sessions' own life span, not the
files'), and a size bound that leaves room for what live sessions persisted recently.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import math
import os
import stat
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal, NoReturn

import anyio
import anyio.to_thread

from pipeline.dropin.tenancy import TENANT_PATTERN
from pipeline.store.files import TOOL_RESULTS_SUBDIR, validate_session_id
from pipeline.store.retention_conversations import prune_stale_conversations
from pipeline.store.retention_files import (
    O_CLOEXEC,
    O_DIRECTORY,
    Found,
    PrunedFile,
    PruneReport,
    file_identity,
    is_persisted_name,
    list_dir,
    lstat_in,
    open_dir,
    owned,
    remove_dir,
    remove_file,
)

__all__ = ["PruneReport", "PrunedFile", "is_persisted_name", "prune_periodically", "prune_store"]


@dataclasses.dataclass(slots=True)
class _Session:
    name: str
    parent: str
    """The tenant directory it is in ("" for a session directly under the root)."""
    entries: set[str]
    """Every name in the session directory."""
    results: set[str]
    """Every name in its ``tool-results`` directory (temp and foreign files included)."""


def prune_store(
    root: str | os.PathLike[str],
    *,
    max_age: timedelta | None = None,
    max_bytes: int | None = None,
    now: datetime | None = None,
    dry_run: bool = False,
    remove_empty_dirs: bool = True,
) -> PruneReport:
    """Remove, with ``max_age``, each conversation directory whose files are all the store's
    and all last modified more than ``max_age`` before ``now`` (its records too: see
    :mod:`pipeline.store.retention_conversations`). Then remove persisted tool results under
    ``root``: those last modified more than ``max_age`` before ``now``, then the oldest (by
    modification time) of the rest until they total at most ``max_bytes``. Then remove each
    ``tool-results`` directory this emptied, and its session directory if nothing else is in
    it.

    Only files :class:`~pipeline.store.files.FileToolResultStore` names as persisted results, in
    real ``<root>/<session>/tool-results/`` directories, are ever looked at: see the module
    docstring. ``max_bytes`` bounds those files only (transcripts and other files are neither
    counted nor removed). ``dry_run``: remove nothing, report what would go.
    ``remove_empty_dirs=False`` leaves the directories in place: beside live sessions (the
    proxy's periodic prune) removing one could race a persist that just made it.

    **Whether a file may go is the caller's call.** A persisted file is referenced by the
    replacement the model saw in its conversation, and the model may read it back at any
    later turn of a session that is still going on (or is resumed): pruning it makes that
    read fail. This function cannot know which sessions are still in use; pass an age past
    which none of yours refers back, and a size bound that leaves room for recent results.

    A missing ``root`` is an empty store (nothing to prune). A file that vanishes meanwhile
    is counted in :attr:`PruneReport.vanished`, never raised; other errors on single files
    or directories are collected in :attr:`PruneReport.errors`. Raises ``ValueError`` for
    no or negative limits, ``NotADirectoryError`` when ``root`` is not a directory, and
    ``OSError`` when ``root`` cannot be read. Blocking file I/O: from async code, call it in
    a worker thread. POSIX only (removals are made relative to directory descriptors, so a
    directory swapped for a symlink during the prune cannot redirect them).
    """
    _check_limits(max_age, max_bytes)
    root_path = Path(root)
    report = PruneReport(root_path, dry_run)
    now_ts = now.timestamp() if now is not None else time.time()
    try:
        # the root is the caller's choice of directory, a symlink to one included; nothing
        # below it is followed
        root_fd = os.open(root_path, os.O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    except FileNotFoundError:
        return report
    except NotADirectoryError:
        raise NotADirectoryError(
            errno.ENOTDIR, "store root is not a directory", str(root)
        ) from None
    try:
        if max_age is not None:
            cutoff = now_ts - max_age.total_seconds()
            prune_stale_conversations(root_path, root_fd, cutoff, report)
        sessions, found = _scan(root_path, root_fd, report)
        if report.removed_conversations:  # a dry run's: what the first phase would remove
            gone = {str(p) for p in report.removed_conversations}
            found = [f for f in found if str(root_path / f.session) not in gone]
        doomed = _choose(found, max_age, max_bytes, now_ts)
        kept = [f for f in found if (f.session, f.name) not in doomed]
        report.kept_files = len(kept)
        report.kept_bytes = sum(f.size for f in kept)
        by_session: dict[str, list[tuple[Found, Literal["age", "size"]]]] = {}
        for f in found:
            reason = doomed.get((f.session, f.name))
            if reason is not None:
                by_session.setdefault(f.session, []).append((f, reason))
        for session in sorted(by_session):
            _remove_session_files(
                root_path,
                root_fd,
                sessions[session],
                by_session[session],
                report,
                remove_empty_dirs=remove_empty_dirs,
            )
    finally:
        os.close(root_fd)
    return report


async def prune_periodically(
    root: str | os.PathLike[str],
    *,
    interval: float,
    max_age: timedelta | None = None,
    max_bytes: int | None = None,
    on_report: Callable[[PruneReport], None] | None = None,
    on_error: Callable[[Exception], None] | None = None,
) -> NoReturn:
    """:func:`prune_store` every ``interval`` seconds, until cancelled (for a long-lived
    process such as the proxy; the same caution about live sessions applies).

    The first prune is one ``interval`` after the start: prune at start-up by calling
    :func:`prune_store` first. It leaves empty directories in place (a live session may be
    about to write into one). Each prune runs in a worker thread; its report goes to
    ``on_report``. An error (the root unreadable, say) goes to ``on_error`` and the next
    prune is tried an interval later: this never raises but for bad arguments
    (``ValueError``, at once).
    """
    if not (math.isfinite(interval) and interval > 0):
        raise ValueError(f"interval must be a positive number of seconds, got {interval}")
    _check_limits(max_age, max_bytes)
    prune = functools.partial(
        prune_store, root, max_age=max_age, max_bytes=max_bytes, remove_empty_dirs=False
    )
    while True:
        await anyio.sleep(interval)
        try:
            report = await anyio.to_thread.run_sync(prune)
        except Exception as exc:  # a background task that raised would stop its host
            if on_error is not None:
                on_error(exc)
            continue
        if on_report is not None:
            on_report(report)


def _check_limits(max_age: timedelta | None, max_bytes: int | None) -> None:
    if max_age is None and max_bytes is None:
        raise ValueError("give max_age or max_bytes (or both): nothing to prune by")
    if max_age is not None and max_age < timedelta(0):
        raise ValueError(f"max_age must not be negative, got {max_age}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must not be negative, got {max_bytes}")


def _scan(root: Path, root_fd: int, report: PruneReport) -> tuple[dict[str, _Session], list[Found]]:
    """Every persisted result under the root, and what each session directory holds: the
    sessions directly under the root, and those of each tenant's directory
    (``<root>/<tenant>/<session>``: see :mod:`pipeline.dropin.tenancy`)."""
    sessions: dict[str, _Session] = {}
    found: list[Found] = []
    for name in sorted(list_dir(root_fd, root, report)):
        if TENANT_PATTERN.fullmatch(name):
            with open_dir(root, root_fd, name, report) as tenant_fd:
                if tenant_fd is None:
                    continue
                entries = list_dir(tenant_fd, root / name, report)
                if TOOL_RESULTS_SUBDIR not in entries:  # a tenant's, not a session named so
                    for session in sorted(entries):
                        _scan_session(
                            root / name, tenant_fd, session, name, sessions, found, report
                        )
                    continue
        _scan_session(root, root_fd, name, "", sessions, found, report)
    return sessions, found


def _scan_session(
    base: Path,
    base_fd: int,
    session: str,
    parent: str,
    sessions: dict[str, _Session],
    found: list[Found],
    report: PruneReport,
) -> None:
    """The persisted results of the session directory ``session`` in ``base``."""
    try:
        validate_session_id(session)
    except ValueError:
        return  # not a name the store gives a session directory
    key = f"{parent}/{session}" if parent else session
    with open_dir(base, base_fd, session, report) as session_fd:
        if session_fd is None:
            return
        entries = set(list_dir(session_fd, base / session, report))
        if TOOL_RESULTS_SUBDIR not in entries:
            return
        where = base / session / TOOL_RESULTS_SUBDIR
        with open_dir(where.parent, session_fd, TOOL_RESULTS_SUBDIR, report) as results_fd:
            if results_fd is None:
                return
            results = set(list_dir(results_fd, where, report))
            sessions[key] = _Session(session, parent, entries, results)
            for name in sorted(results):
                if not is_persisted_name(name):
                    continue
                st = lstat_in(results_fd, where, name, report)
                if st is None or not stat.S_ISREG(st.st_mode) or not owned(st):
                    continue  # a symlink, a directory, another user's file: not ours
                found.append(Found(key, name, st.st_size, st.st_mtime, file_identity(st)))


def _choose(
    found: list[Found], max_age: timedelta | None, max_bytes: int | None, now: float
) -> dict[tuple[str, str], Literal["age", "size"]]:
    """(session, name) → why, of each file to remove."""
    doomed: dict[tuple[str, str], Literal["age", "size"]] = {}
    rest = found
    if max_age is not None:
        cutoff = now - max_age.total_seconds()
        for f in found:
            if f.mtime < cutoff:
                doomed[f.session, f.name] = "age"
        rest = [f for f in found if (f.session, f.name) not in doomed]
    if max_bytes is not None:
        total = sum(f.size for f in rest)
        # oldest first; the name breaks ties so the same store always loses the same files
        for f in sorted(rest, key=lambda f: (f.mtime, f.session, f.name)):
            if total <= max_bytes:
                break
            doomed[f.session, f.name] = "size"
            total -= f.size
    return doomed


def _remove_session_files(
    root: Path,
    root_fd: int,
    session: _Session,
    victims: list[tuple[Found, Literal["age", "size"]]],
    report: PruneReport,
    *,
    remove_empty_dirs: bool = True,
) -> None:
    """Remove one session's chosen files, then the directories that leaves empty."""
    if not session.parent:
        _remove_in(root, root_fd, session, victims, report, remove_empty_dirs=remove_empty_dirs)
        return
    with open_dir(root, root_fd, session.parent, report) as parent_fd:
        if parent_fd is None:
            report.vanished += len(victims)
            return
        base = root / session.parent
        _remove_in(base, parent_fd, session, victims, report, remove_empty_dirs=remove_empty_dirs)


def _remove_in(
    base: Path,
    base_fd: int,
    session: _Session,
    victims: list[tuple[Found, Literal["age", "size"]]],
    report: PruneReport,
    *,
    remove_empty_dirs: bool,
) -> None:
    where = base / session.name / TOOL_RESULTS_SUBDIR
    gone: set[str] = set()
    with open_dir(base, base_fd, session.name, report) as session_fd:
        if session_fd is None:
            report.vanished += len(victims)
            return
        with open_dir(where.parent, session_fd, TOOL_RESULTS_SUBDIR, report) as results_fd:
            if results_fd is None:
                report.vanished += len(victims)
                return
            for f, reason in victims:
                outcome = remove_file(results_fd, where, f, report)
                if outcome == "removed":
                    report.removed.append(PrunedFile(where / f.name, f.size, f.mtime, reason))
                if outcome != "kept":
                    gone.add(f.name)
        if not remove_empty_dirs or session.results - gone:
            return  # anything else there (a temp file in flight, a foreign file) stays
        if not remove_dir(session_fd, where.parent, TOOL_RESULTS_SUBDIR, report):
            return
        if session.entries - {TOOL_RESULTS_SUBDIR}:
            return
    remove_dir(base_fd, base, session.name, report)
