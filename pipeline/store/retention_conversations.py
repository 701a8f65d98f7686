"""Retention of whole conversations: a conversation directory nothing has written to for longer
than the retention age goes, records and calibration included (:func:`prune_store`'s first
phase, by age only).

A drop-in makes a conversation directory for every request that starts a conversation: a
batch of one-shot calls leaves one each (``decisions.jsonl``, ``token-calibration.json``),
forever, were only persisted results pruned. A conversation directory is removed when

- it holds a conversation's records, and every name in it is one the store writes there:
  ``decisions.jsonl`` and a branch's ``decisions.f<16 hex>.jsonl``,
  ``token-calibration.json`` and a branch's ``token-calibration-f<16 hex>.json``, and a
  ``tool-results`` directory holding only persisted results -- all regular files of this
  user, none a symbolic link;
- and every one of those files was last modified before the cutoff.

Anything else there (a temp file in flight, a transcript, a file someone put there) keeps the
whole directory. Each file is removed only if it is still the file scanned; a file written
since keeps its directory. A conversation that comes back after its directory went is a new
conversation to the store: its results are decided again, and those that stand before the
model's last answer count as sent whole -- the retention age is the age past which you do not
expect a conversation back.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

from pipeline.dropin.tenancy import TENANT_PATTERN
from pipeline.store import retention_files as steps
from pipeline.store.files import TOOL_RESULTS_SUBDIR, validate_session_id
from pipeline.store.sessions import DECISIONS_FILE
from pipeline.tokens.state_file import CALIBRATION_FILE

__all__ = ["prune_stale_conversations"]

_BRANCH = r"f[0-9a-f]{16}"
_OWN_FILE = re.compile(
    rf"{re.escape(DECISIONS_FILE)}|decisions\.{_BRANCH}\.jsonl"
    rf"|{re.escape(CALIBRATION_FILE)}|token-calibration-{_BRANCH}\.json"
)


def prune_stale_conversations(
    root: Path, root_fd: int, cutoff: float, report: steps.PruneReport
) -> None:
    """Remove each conversation directory under ``root`` (or a tenant's directory in it) whose
    files are all the store's and all older than ``cutoff`` (POSIX seconds); in a dry run,
    say which would go. Removed directories are added to ``report.removed_dirs``, their
    persisted results to ``report.removed``."""
    for name in sorted(steps.list_dir(root_fd, root, report)):
        if not TENANT_PATTERN.fullmatch(name):
            _prune_if_stale(root, root_fd, name, cutoff, report)
            continue
        with steps.open_dir(root, root_fd, name, report) as tenant_fd:
            if tenant_fd is None:
                continue
            for conversation in sorted(steps.list_dir(tenant_fd, root / name, report)):
                _prune_if_stale(root / name, tenant_fd, conversation, cutoff, report)


def _prune_if_stale(
    base: Path, base_fd: int, name: str, cutoff: float, report: steps.PruneReport
) -> None:
    try:
        validate_session_id(name)
    except ValueError:
        return  # not a name the store gives a conversation directory
    where = base / name
    with steps.open_dir(base, base_fd, name, report) as conv_fd:
        if conv_fd is None:
            return
        own = _stale_files(conv_fd, where, cutoff, report)
        if own is None:
            return
        files, results = own
        if results is not None:
            with steps.open_dir(where, conv_fd, TOOL_RESULTS_SUBDIR, report) as results_fd:
                if results_fd is None:
                    return
                if not _remove_all(results_fd, where / TOOL_RESULTS_SUBDIR, results, report):
                    return
            if not steps.remove_dir(conv_fd, where, TOOL_RESULTS_SUBDIR, report):
                return
        if not _remove_all(conv_fd, where, files, report):
            return
    if steps.remove_dir(base_fd, base, name, report):
        report.removed_conversations.append(where)


def _stale_files(
    conv_fd: int, where: Path, cutoff: float, report: steps.PruneReport
) -> tuple[list[steps.Found], list[steps.Found] | None] | None:
    """The directory's own files and its persisted results (None: no ``tool-results``), when
    every name in it is the store's and every file older than ``cutoff``; else None."""
    files: list[steps.Found] = []
    results: list[steps.Found] | None = None
    for entry in steps.list_dir(conv_fd, where, report):
        if entry == TOOL_RESULTS_SUBDIR:
            with steps.open_dir(where, conv_fd, entry, report) as results_fd:
                if results_fd is None:
                    return None  # a symbolic link, another user's: not the store's
                results = []
                for result in steps.list_dir(results_fd, where / entry, report):
                    if not steps.is_persisted_name(result):
                        return None
                    found = _stale(results_fd, where / entry, result, cutoff, report)
                    if found is None:
                        return None
                    results.append(found)
            continue
        if not _OWN_FILE.fullmatch(entry):
            return None
        found = _stale(conv_fd, where, entry, cutoff, report)
        if found is None:
            return None
        files.append(found)
    if not any(f.name.startswith("decisions") for f in files):
        return None  # no records: not a conversation's (persisted results alone, an agent's)
    return files, results


def _stale(
    dir_fd: int, where: Path, name: str, cutoff: float, report: steps.PruneReport
) -> steps.Found | None:
    st = steps.lstat_in(dir_fd, where, name, report)
    if st is None or not stat.S_ISREG(st.st_mode) or not steps.owned(st) or st.st_mtime >= cutoff:
        return None
    return steps.Found(str(where), name, st.st_size, st.st_mtime, steps.file_identity(st))


def _remove_all(
    dir_fd: int, where: Path, found: list[steps.Found], report: steps.PruneReport
) -> bool:
    """Remove each file; whether every one is gone (one changed since its scan stays)."""
    whole = True
    for f in found:
        outcome = steps.remove_file(dir_fd, where, f, report)
        if outcome == "kept":
            whole = False
        elif outcome == "removed" and where.name == TOOL_RESULTS_SUBDIR:
            report.removed.append(steps.PrunedFile(where / f.name, f.size, f.mtime, "age"))
    return whole
