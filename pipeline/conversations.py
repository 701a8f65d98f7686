"""Which conversation a request belongs to: its tenant, then the conversation whose messages it
begins with.

A drop-in (``wrap``, the proxy) is handed requests, not conversations. Each request is placed
by what it holds, never by a name alone:

- **Tenant.** The request's credential decides whose conversations it may join
  (:mod:`pipeline.tenancy`): another key's conversations are never found, whatever the
  request names. Every conversation's records and results live under its tenant:
  ``<root>/<tenant>/<conversation>/``.
- **Family.** A conversation opens with a system prompt and a first message. Requests that
  open alike, with the same hint, form a family: the hint is the caller's explicit id
  (``wrap(session_id=...)``, the ``x-sluicegate-session`` header), else Claude Code's session
  (``metadata.user_id``), else none. What a client moves between calls does not count:
  ``cache_control`` anywhere, and Claude Code's billing-header line in the system prompt.
- **Prefix.** Within a family, each message is known by a digest of itself and every message
  before it (a chain). A request continues the conversation whose last request it extends
  (its messages begin with all of that request's); a request that shares only part of one
  goes another way from it -- a fork, an edit, a rewind -- and becomes a conversation of its
  own, a *branch*, which starts from the other's decisions (:meth:`WireSession.inherit`), so
  the part they share goes out as the other sent it. A request that sends again what a
  conversation sent before (a retry) is that conversation's. Two requests that open alike
  stay one conversation only while one extends the other.

Finding the conversation costs one comparison per message with the last request of the most
recent one (C-level), and a digest per new message; the digests are kept with each
conversation's records (``chain`` in its response records), so a new process, or another
worker on the same object store, places requests as this one would. A branch's name is the
family's, then ``.f`` and 16 hex of the digest of the first message in which it went its own
way: every worker names the same branch alike.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from pipeline.adapter import WireSession
from pipeline.logs import get_logger
from pipeline.messages import Message
from pipeline.replacement import read_results
from pipeline.session_storage import SessionStates, SessionStorage
from pipeline.storage import validate_session_id
from pipeline.tenancy import Tenancy
from pipeline.tokens import TokenTracker, calibration_path_for

if TYPE_CHECKING:
    import os

    from pipeline.core import Pipeline

__all__ = [
    "SESSION_HEADER",
    "Branch",
    "Conversations",
    "chain_step",
    "conversation_hint",
    "message_digest",
]

SESSION_HEADER = "x-sluicegate-session"
"""The request header a client names its conversation with (a hint: see the module)."""

T = TypeVar("T")
_DIGEST_BYTES = 16
_CLAUDE_CODE_SESSION = re.compile(r"_session_([0-9a-fA-F-]{36})$")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_BILLING_HEADER = "x-anthropic-billing-header:"
_LABEL_CHARS = 48
_ROOT = b"\x00" * _DIGEST_BYTES


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def _canonical(value: Any) -> bytes:
    text = json.dumps(
        value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr
    )
    return text.encode("utf-8", "surrogatepass")


def _plain_blocks(content: Any) -> Any:
    """Content with ``cache_control`` off its blocks and off the blocks a tool_result holds."""
    if not isinstance(content, list):
        return content
    out = []
    for b in content:
        if isinstance(b, Mapping):
            plain = {k: v for k, v in b.items() if k != "cache_control"}
            inner = plain.get("content")
            if isinstance(inner, list):
                plain["content"] = _plain_blocks(inner)
            out.append(plain)
        else:
            out.append(b)
    return out


def message_digest(param: Any) -> bytes:
    """16 bytes that tell a message from any other, breakpoints (``cache_control``) aside."""
    if isinstance(param, Mapping):
        value: Any = {"role": param.get("role"), "content": _plain_blocks(param.get("content"))}
    else:
        value = param
    return _hash(_canonical(value))


def chain_step(previous: bytes, message: bytes) -> bytes:
    """The digest of a message and everything before it (``previous``: the digest up to the
    message before it)."""
    return _hash(previous + message)


def _system_digest(system: Any) -> bytes:
    """The system prompt's digest, less Claude Code's billing-header line (it differs between
    a conversation and its sub-agents) and breakpoints."""
    if isinstance(system, str):
        kept: Any = "\n".join(
            line for line in system.split("\n") if not line.startswith(_BILLING_HEADER)
        )
    elif isinstance(system, list):
        kept = [
            b
            for b in _plain_blocks(system)
            if not (
                isinstance(b, Mapping)
                and isinstance(b.get("text"), str)
                and b["text"].startswith(_BILLING_HEADER)
            )
        ]
    else:
        kept = system
    return _hash(_canonical(kept))


def conversation_hint(
    body: Mapping[str, Any],
    *,
    explicit: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> str:
    """The hint a request carries of its conversation: ``explicit`` (the caller's argument),
    else the ``x-sluicegate-session`` header, else ``cc-<uuid>`` for Claude Code's session
    (``metadata.user_id``: a JSON object with ``session_id`` in 2.x, ``..._session_<uuid>``
    before), else ``""``. ``ValueError`` when an explicit id or the header is not a safe
    session id (``[A-Za-z0-9_.-]{1,128}``)."""
    chosen = explicit
    if chosen is None and headers is not None:
        chosen = next((v for k, v in headers.items() if k.lower() == SESSION_HEADER), None)
    if chosen is not None:
        return validate_session_id(chosen)
    claude_code = _claude_code_session(body.get("metadata"))
    return "" if claude_code is None else f"cc-{claude_code}"


def _claude_code_session(metadata: Any) -> str | None:
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    if not isinstance(user_id, str):
        return None
    try:
        parsed = json.loads(user_id)
    except ValueError:
        parsed = None
    session = parsed.get("session_id") if isinstance(parsed, dict) else None
    if session is None:
        found = _CLAUDE_CODE_SESSION.search(user_id)
        session = found.group(1) if found else None
    if isinstance(session, str) and _UUID.fullmatch(session):
        return session.lower()
    return None


def _family_name(hint: str, opening: bytes) -> str:
    """``<hint label>-<24 hex>`` (``fp-...`` without a hint): a directory name that shows the
    hint, bounded in length whatever the hint."""
    label = hint or "fp"
    if len(label) > _LABEL_CHARS:
        label = f"{label[:32]}_{hashlib.sha256(label.encode()).hexdigest()[:15]}"
    return f"{label}-{opening.hex()[:24]}"


@dataclass(eq=False)
class Branch:
    """One conversation of a family: its session and how it was last routed."""

    family: Family
    name: str | None
    """None for the family's first conversation, ``f<16 hex>`` for a branch."""
    session: WireSession
    params: list[Any] = field(default_factory=list)
    """The messages of the last request routed here, as the client sent them (empty when not
    known: loaded from records, only the digests are)."""
    call_lock: anyio.Lock = field(default_factory=anyio.Lock)
    """What a caller that must not overlap two calls of a conversation takes (the proxy)."""

    @property
    def chain(self) -> list[bytes]:
        """The digests of the messages of the last request routed here."""
        return self.session.chain

    @property
    def conversation_id(self) -> str:
        """The conversation's name: the family's, then ``.<branch>`` for a branch."""
        return _named(self.family.name, self.name)


@dataclass(eq=False)
class Family:
    """The conversations of one tenant that open alike, and the index of what they sent."""

    tenant: str
    name: str
    states: SessionStates
    """The tenant's sessions."""
    calibration_root: Path
    branches: dict[str | None, Branch] = field(default_factory=dict)
    owner: dict[bytes, Branch] = field(default_factory=dict)
    """A chain digest -> the first conversation that sent that prefix."""
    ends: dict[bytes, Branch] = field(default_factory=dict)
    """The chain digest of a conversation's last request -> that conversation."""
    recent: list[Branch] = field(default_factory=list)
    """Most recently routed first."""

    def register(self, branch: Branch, chain: list[bytes], start: int) -> None:
        """``branch`` now ends with ``chain`` (new from ``start``)."""
        old = branch.session.chain
        if old and self.ends.get(old[-1]) is branch:
            del self.ends[old[-1]]
        for c in chain[start:]:
            self.owner.setdefault(c, branch)
        if chain:
            self.ends[chain[-1]] = branch
        if branch in self.recent:
            self.recent.remove(branch)
        self.recent.insert(0, branch)


class Conversations:
    """Every conversation a drop-in serves, found by tenant and prefix (see the module).

    ``pipeline``: a factory of each conversation's stages; ``storage``: where their state lives
    (a :class:`~pipeline.session_storage.SessionStates` or a location for one; default the
    files under ``root``); ``root``: where each host keeps its token calibration (under the
    tenant's directory); ``tenancy``: how requests are told apart (default: by credential, under
    the store's secret; ``Tenancy(single=True)`` for one tenant); ``context``: keyword
    arguments of each session (``cache_breakpoint``, tool policies, a tracer, a logger).
    :meth:`route` (async) and :meth:`route_sync` place a request; both are safe from many
    tasks or threads at once (the index is guarded by a lock never held across I/O).
    """

    def __init__(
        self,
        *,
        pipeline: Callable[[], Pipeline],
        root: str | os.PathLike[str] = ".sluicegate",
        storage: SessionStates | str | os.PathLike[str] | None = None,
        tenancy: Tenancy | None = None,
        **context: Any,
    ) -> None:
        self.root = Path(root)
        self.states = (
            storage if isinstance(storage, SessionStates) else SessionStates(storage or root)
        )
        self.pipeline = pipeline
        self.context = context
        self._tenancy = tenancy
        self._families: dict[tuple[str, str], Family] = {}
        self._lock = threading.Lock()

    # -- the way in --------------------------------------------------------------------------
    async def route(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        explicit: str | None = None,
    ) -> Branch:
        """The conversation of a request (``body``: its JSON; ``headers``: its HTTP headers),
        a new one made if it continues none. Loads from the store in a worker thread.
        ``ValueError`` for a bad hint or a request without a ``messages`` list; ``OSError``
        when the store cannot be read."""
        tenancy = self._tenancy
        if tenancy is None:
            tenancy = await anyio.to_thread.run_sync(self._make_tenancy)
        tenant, name, messages, opening = self._key(tenancy, body, headers, explicit)
        family = self._families.get((tenant, name))
        if family is None:
            loaded = await anyio.to_thread.run_sync(self._load_family, tenant, name)
            with self._lock:
                family = self._families.setdefault((tenant, name), loaded)
        return self._place(family, messages, opening, build=_call)

    def route_sync(
        self,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        *,
        explicit: str | None = None,
        build: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> Branch:
        """:meth:`route` for a synchronous caller (blocking I/O inline). ``build``: how to run
        the making of a new session (the sync ``wrap`` makes them in a worker thread, away
        from whatever event loop the caller runs); a branch's parent is read under its
        :attr:`~pipeline.adapter.WireSession.sync_lock`."""
        run = build or _call
        tenancy = self._tenancy or self._make_tenancy()
        tenant, name, messages, opening = self._key(tenancy, body, headers, explicit)
        family = self._families.get((tenant, name))
        if family is None:
            loaded = run(lambda: self._load_family(tenant, name))
            with self._lock:
                family = self._families.setdefault((tenant, name), loaded)
        return self._place(family, messages, opening, build=run, sync=True)

    def branches(self) -> list[Branch]:
        """Every conversation held in memory."""
        with self._lock:
            return [b for f in self._families.values() for b in f.branches.values()]

    async def reload(self, branch: Branch) -> None:
        """Load ``branch``'s session again from its records (another worker served it), in a
        worker thread; the index learns what its records say it sent. ``OSError`` when the
        store cannot be read."""
        family = branch.family
        session = await WireSession.open(
            branch.conversation_id,
            family.calibration_root,
            self.pipeline(),
            storage=branch.session.storage,
            **self.context,
        )
        with self._lock:
            old = branch.session
            if old.chain and family.ends.get(old.chain[-1]) is branch:
                del family.ends[old.chain[-1]]
            branch.session = session
            branch.params = []
            for c in session.chain:
                family.owner.setdefault(c, branch)
            if session.chain:
                family.ends[session.chain[-1]] = branch

    # -- placing -------------------------------------------------------------------------------
    def _make_tenancy(self) -> Tenancy:
        made = Tenancy(self.states.secret())
        with self._lock:
            if self._tenancy is None:
                self._tenancy = made
            return self._tenancy

    def _key(
        self,
        tenancy: Tenancy,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        explicit: str | None,
    ) -> tuple[str, str, list[Any], bytes]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ValueError("a Messages request needs a 'messages' list")
        hint = conversation_hint(body, explicit=explicit, headers=headers)
        tenant = tenancy.tenant_of(headers)
        system = _system_digest(body.get("system"))
        first = message_digest(messages[0]) if messages else _ROOT
        opening = chain_step(_hash(system + hint.encode()), first)
        return tenant, _family_name(hint, opening), messages, opening

    def _load_family(self, tenant: str, name: str) -> Family:
        """A family as its records leave it (blocking: a listing and every branch's records)."""
        states = self.states.within(tenant)
        family = Family(tenant, name, states, self.root / tenant)
        for branch_name in states.branches(name):
            storage = states.open(name, branch=branch_name)
            tracker = TokenTracker.load(
                calibration_path_for(family.calibration_root, name, branch_name)
            )
            session = self._session(
                family, branch_name, storage, loaded=storage.load(), token_tracker=tracker
            )
            branch = Branch(family, branch_name, session)
            family.branches[branch_name] = branch
            family.register(branch, session.chain, 0)
        family.recent.reverse()  # the first conversation first
        return family

    def _session(
        self, family: Family, name: str | None, storage: SessionStorage, **options: Any
    ) -> WireSession:
        return WireSession(
            _named(family.name, name),
            family.calibration_root,
            self.pipeline(),
            storage=storage,
            **options,
            **self.context,
        )

    def _place(
        self,
        family: Family,
        messages: list[Any],
        opening: bytes,
        *,
        build: Callable[[Callable[[], Any]], Any],
        sync: bool = False,
    ) -> Branch:
        with self._lock:
            found = self._extends(family, messages)
            if found is not None:
                branch, start = found
                chain = _extend(branch.chain[:start], messages, start, opening)
                self._set(family, branch, messages, chain, start)
                return branch
            shared, chain = self._shared_prefix(family, messages, opening)
            known = 0
            while known < len(chain) and chain[known] in family.owner:
                known += 1
            if not family.branches:
                branch = self._new_branch(family, None, None, messages, chain, 0, build, sync)
            elif not chain:
                branch = family.recent[0]
            elif known == len(chain):
                end = chain[-1]  # all of it sent before: a retry, or a twin
                branch = family.ends.get(end) or family.owner[end]
            elif known == 0:
                # no conversation's messages are known (recorded before any response): the
                # most recent one, whose decisions apply only to what they were made on
                branch = family.recent[0]
            elif chain[known - 1] in family.ends:
                branch = family.ends[chain[known - 1]]
            else:
                parent = family.owner[chain[known - 1]]
                name = f"f{chain[known].hex()[:16]}"
                branch = family.branches.get(name) or self._new_branch(
                    family, name, parent, messages, chain, known, build, sync
                )
            self._set(family, branch, messages, chain, min(shared, known))
            return branch

    def _extends(self, family: Family, messages: list[Any]) -> tuple[Branch, int] | None:
        """The conversation whose last request this one extends, compared by value (most
        recent first; one message compared to rule most out)."""
        n = len(messages)
        for branch in family.recent:
            params = branch.params
            m = len(params)
            if not m or m > n or m != len(branch.chain):
                continue
            if messages[m - 1] == params[m - 1] and messages[:m] == params:
                return branch, m
        return None

    def _shared_prefix(
        self, family: Family, messages: list[Any], opening: bytes
    ) -> tuple[int, list[bytes]]:
        """The request's chain, the part it shares by value with the most recent conversation
        taken from that one's (not digested again)."""
        shared, base = 0, []
        if family.recent:
            recent = family.recent[0]
            params, chain = recent.params, recent.chain
            limit = min(len(params), len(chain), len(messages))
            while shared < limit and messages[shared] == params[shared]:
                shared += 1
            base = chain[:shared]
        return shared, _extend(base, messages, shared, opening)

    def _set(
        self,
        family: Family,
        branch: Branch,
        messages: list[Any],
        chain: list[bytes],
        start: int,
    ) -> None:
        family.register(branch, chain, start)
        branch.params = list(messages)
        branch.session.set_chain(chain, start)

    def _new_branch(
        self,
        family: Family,
        name: str | None,
        parent: Branch | None,
        messages: list[Any],
        chain: list[bytes],
        at: int,
        build: Callable[[Callable[[], Any]], Any],
        sync: bool,
    ) -> Branch:
        storage = family.states.open(family.name, branch=name)
        inherited = None
        if parent is not None:
            keys = _result_keys(messages)
            if sync:
                with parent.session.sync_lock:
                    inherited = parent.session.inherit(at, keys)
            else:
                inherited = parent.session.inherit(at, keys)
            inherited.chain = chain[:at]
            get_logger(session_id=_named(family.name, name)).info(
                "wire_session.forked", parent=parent.conversation_id, shared_messages=at
            )

        def make() -> WireSession:
            return self._session(family, name, storage, loaded=None, inherited=inherited)

        branch = Branch(family, name, build(make))
        family.branches[name] = branch
        return branch


def _result_keys(messages: Sequence[Any]) -> set[str]:
    """The ledger keys of the tool results a request holds (what a branch inherits decisions
    on): the other conversation's decisions on anything else stay with it."""
    keys: set[str] = set()
    for param in messages:
        if not (isinstance(param, Mapping) and param.get("role") == "user"):
            continue
        try:
            record = Message.from_param(param)
        except ValueError:
            continue
        keys.update(slot.key for slot in read_results(record) if slot.key is not None)
    return keys


def _named(family: str, branch: str | None) -> str:
    return family if branch is None else f"{family}.{branch}"


def _call(fn: Callable[[], T]) -> T:
    return fn()


def _extend(base: list[bytes], messages: Sequence[Any], start: int, opening: bytes) -> list[bytes]:
    """``base`` (the chain of ``messages[:start]``) extended over the rest of ``messages``.
    The first message's link is the family's opening digest (system prompt and hint in it)."""
    chain = list(base)
    for i in range(start, len(messages)):
        if i == 0:
            chain.append(opening)
        else:
            chain.append(chain_step(chain[-1], message_digest(messages[i])))
    return chain
