"""The file-system steps of retention (:mod:`pipeline.store.retention`), and what a prune reports.

Every step is made relative to a directory descriptor and never follows a symbolic link: a
directory swapped for a link during a prune cannot redirect a removal. A file is removed only
if its name still holds the file scanned (device, inode, times, size), and only files of the
user running the prune are looked at.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pipeline.store.files import safe_file_stem

__all__ = [
    "O_CLOEXEC",
    "O_DIRECTORY",
    "Found",
    "PruneReport",
    "PrunedFile",
    "file_identity",
    "is_persisted_name",
    "list_dir",
    "lstat_in",
    "open_dir",
    "owned",
    "remove_dir",
    "remove_file",
]

# <stem>[.<12 hex of the content's sha256>].<txt|json>, the stem an id safe as it is or
# unsafe.<sha256 hex> (see pipeline.store.files); a temp file starts with "." and never matches
PERSISTED_NAME = re.compile(
    r"(?P<stem>unsafe\.[0-9a-f]{64}|[A-Za-z0-9_-]{1,128})(?:\.[0-9a-f]{12})?\.(?:txt|json)"
)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_persisted_name(name: str) -> bool:
    """Whether ``name`` is a name :class:`~pipeline.store.files.FileToolResultStore` gives a
    persisted result (a temp file's, a Windows device name's, or any other name is not)."""
    match = PERSISTED_NAME.fullmatch(name)
    if match is None:
        return False
    stem = match["stem"]
    # a stem the store would have hashed (CON, nul, ...) was never written under that name
    return stem.startswith("unsafe.") or safe_file_stem(stem) == stem


@dataclasses.dataclass(frozen=True, slots=True)
class PrunedFile:
    """One persisted result removed (or, in a dry run, that would be)."""

    path: Path
    size: int
    mtime: float
    """Modification time (POSIX seconds) when it was looked at."""
    reason: Literal["age", "size"]
    """``age``: older than ``max_age``; ``size``: among the oldest over ``max_bytes``."""


@dataclasses.dataclass(slots=True)
class PruneReport:
    """What :func:`prune_store` removed (in a dry run: would remove) and what is left."""

    root: Path
    dry_run: bool
    removed: list[PrunedFile] = dataclasses.field(default_factory=list)
    removed_dirs: list[Path] = dataclasses.field(default_factory=list)
    """``tool-results`` and session directories removed once empty."""
    removed_conversations: list[Path] = dataclasses.field(default_factory=list)
    """Conversation directories removed whole: nothing written to them within the age."""
    kept_files: int = 0
    """Persisted results left in place."""
    kept_bytes: int = 0
    vanished: int = 0
    """Files chosen for removal that were already gone (another prune, a user): not errors."""
    errors: list[tuple[Path, str]] = dataclasses.field(default_factory=list)
    """Files or directories that could not be removed or read, and why."""

    @property
    def removed_count(self) -> int:
        """How many persisted results were removed."""
        return len(self.removed)

    @property
    def removed_bytes(self) -> int:
        """Their total size in bytes."""
        return sum(f.size for f in self.removed)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values (paths as strings)."""
        return {
            "store": str(self.root),
            "dry_run": self.dry_run,
            "removed_files": self.removed_count,
            "removed_bytes": self.removed_bytes,
            "removed_by_age": sum(1 for f in self.removed if f.reason == "age"),
            "removed_by_size": sum(1 for f in self.removed if f.reason == "size"),
            "removed_dirs": [str(d) for d in self.removed_dirs],
            "removed_conversations": len(self.removed_conversations),
            "kept_files": self.kept_files,
            "kept_bytes": self.kept_bytes,
            "vanished": self.vanished,
            "errors": [{"path": str(p), "error": e} for p, e in self.errors],
            "files": [
                {"path": str(f.path), "bytes": f.size, "mtime": f.mtime, "reason": f.reason}
                for f in self.removed
            ],
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    session: str
    name: str
    size: int
    mtime: float
    identity: tuple[int, ...]
    """What the file was when scanned (device, inode, ctime, mtime, size): a file written
    under the name since -- a freed inode number is reused at once -- is not removed."""


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size)


def remove_file(
    dir_fd: int, where: Path, f: Found, report: PruneReport
) -> Literal["removed", "vanished", "kept"]:
    """Unlink ``f`` if the name still holds the file scanned (in a dry run: say it would)."""
    try:
        st = os.stat(f.name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or file_identity(st) != f.identity:
            return "kept"  # replaced since the scan: not the file that was chosen
        if not report.dry_run:
            # unlink never follows a symlink, and relative to the descriptor of the directory
            # scanned, a directory swapped for a symlink since cannot redirect it
            os.unlink(f.name, dir_fd=dir_fd)
    except FileNotFoundError:
        report.vanished += 1
        return "vanished"
    except OSError as exc:
        report.errors.append((where / f.name, exc.strerror or str(exc)))
        return "kept"
    return "removed"


def remove_dir(parent_fd: int, parent: Path, name: str, report: PruneReport) -> bool:
    """rmdir ``name`` if empty; whether it was (or, in a dry run, would be) removed."""
    path = parent / name
    if not report.dry_run:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except OSError:
            # not empty after all (a writer persisted meanwhile), or gone: both fine
            return False
    report.removed_dirs.append(path)
    return True


@contextlib.contextmanager
def open_dir(parent: Path, parent_fd: int, name: str, report: PruneReport) -> Iterator[int | None]:
    """A descriptor of the real directory ``name`` in ``parent`` (None: missing, a symlink or
    not a directory), closed on exit."""
    flags = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent_fd)
    except OSError as exc:
        # ELOOP/ENOTDIR: a symlink or a file where a directory is expected, never followed
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            report.errors.append((parent / name, exc.strerror or str(exc)))
        yield None
        return
    try:
        st = os.fstat(fd)
        yield fd if stat.S_ISDIR(st.st_mode) and owned(st) else None
    finally:
        os.close(fd)


def list_dir(fd: int, where: Path, report: PruneReport) -> list[str]:
    try:
        return os.listdir(fd)
    except FileNotFoundError:
        return []
    except OSError as exc:
        report.errors.append((where, exc.strerror or str(exc)))
        return []


def lstat_in(dir_fd: int, where: Path, name: str, report: PruneReport) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        report.errors.append((where / name, exc.strerror or str(exc)))
        return None


def owned(st: os.stat_result) -> bool:
    # the store only writes (and trusts) what this user owns; another user's file was not
    # written by it
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
