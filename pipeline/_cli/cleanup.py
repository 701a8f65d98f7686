"""Removing what a command made, safely: the temporary store directory (never a directory
swapped in for it, never through a symlink) with Ctrl-C and SIGTERM held back meanwhile."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline._cli.safe_text import terminal_safe

__all__ = ["interrupts_deferred", "remove_made_dir"]


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back for the block (a short cleanup), then delivered as they
    would have been. Main thread only; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)


def remove_made_dir(path: Path, identity: tuple[int, int]) -> bool:
    """Remove the directory a command made at ``path`` and everything in it; whether it is gone.

    ``identity`` is its ``(st_dev, st_ino)`` when it was made: should ``path`` now be a
    symlink or another directory (swapped in by someone else), nothing is removed. Nothing
    inside is followed either (``shutil.rmtree`` removes a symlink, never its target). A
    failure is one warning on stderr, never an exception: the command's own result stands.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        _warn_not_removed(path, exc.strerror or str(exc))
        return False
    if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != identity:
        _warn_not_removed(path, "it is no longer the directory this command made")
        return False
    failures: list[str] = []

    def failed(_func: Callable[..., Any], where: str, exc: BaseException) -> None:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        failures.append(f"{where}: {reason}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=lambda func, where, info: failed(func, where, info[1]))
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        _warn_not_removed(path, failures[0] + more)
        return False
    return True


def _warn_not_removed(path: Path, reason: str) -> None:
    shown = terminal_safe(f"{path}: {reason}", limit=500)
    print(f"sluicegate: warning: temporary store not removed: {shown}", file=sys.stderr)
