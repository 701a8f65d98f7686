"""A family of conversations as its records leave it (:func:`load_family`), and what one of
its conversations not held recorded (:func:`records_of`). Both block (a listing, reads of
records): the index runs them in worker threads.

A family loaded holds its first conversation and the others written last, as many as a family
holds; it reads what the :data:`GONE_READ` written before those sent (their records' chains),
so that a request of one of them goes to it, by its name, and is sent as it sent it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.dropin.adapter import WireSession
from pipeline.dropin.calibration import load_calibration
from pipeline.dropin.families import Branch, Family, named
from pipeline.dropin.session_log import expand
from pipeline.store.sessions import SessionStates
from pipeline.tokens import calibration_path_for
from pipeline.transcript import Transcript

__all__ = ["GONE_READ", "MakeSession", "load_family", "records_of"]

GONE_READ = 256
"""A family's conversations not held whose records are read when it is loaded, at most (the
latest written): what they sent is then known, so their requests go to them."""

MakeSession = Callable[..., WireSession]
"""``(family, branch name, storage, **options) -> WireSession``: how the index makes the
session of one of a family's conversations."""


def load_family(
    states: SessionStates,
    calibration_root: Path,
    key: tuple[str, str, bytes],
    max_branches: int,
    session: MakeSession,
) -> Family:
    """The family ``key`` (tenant, name, opening) as its records in ``states`` (the tenant's)
    leave it, each conversation's token calibration from under ``calibration_root`` (the
    tenant's); at most ``max_branches`` conversations held (see the module)."""
    tenant, name, opening = key
    family = Family(tenant, name, opening, states, calibration_root)
    names = states.branches(name, by_time=True)  # the first, then the latest written last
    first: list[str | None] = [None] if names[:1] == [None] else []
    others = names[len(first) :]
    cut = max(0, len(others) - (max_branches - 1))
    for branch_name in others[max(0, cut - GONE_READ) : cut]:
        assert branch_name is not None
        loaded = states.open(name, branch=branch_name, content_named=True).load()
        if loaded is not None:
            family.remember(branch_name, expand(loaded, named(name, branch_name)).chain)
    for branch_name in first + others[cut:]:
        storage = states.open(name, branch=branch_name, content_named=True)
        tracker = load_calibration(calibration_path_for(calibration_root, name, branch_name))
        options: dict[str, Any] = {"loaded": storage.load(), "token_tracker": tracker}
        made = session(family, branch_name, storage, **options)
        branch = Branch(family, branch_name, made)
        family.branches[branch_name] = branch
        family.register(branch, list(made.chain))
    family.recent.reverse()  # the first conversation first
    return family


def records_of(family: Family, name: str) -> Transcript | None:
    """What the conversation ``name`` of ``family``, not held, recorded (None when its
    records cannot be read): how it decided its results."""
    try:
        loaded = family.states.open(family.name, branch=name, content_named=True).load()
    except OSError:
        return None
    return None if loaded is None else expand(loaded, named(family.name, name)).transcript
