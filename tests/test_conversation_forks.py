"""How many conversations of one family are held (``max_branches``): a client that forks one
conversation again and again grows neither the proxy's memory nor the work of placing each
request without end, and a fork let go comes back with the same bytes."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline.dropin.conversations import Branch, Conversations
from tests.test_conversations import KEY_A, answer, body, call, registry, send, user
from tests.wire_support import TAG

OK = {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}


def _family_index(conversations: Conversations) -> tuple[int, int, int]:
    """(conversations, prefixes known, last requests known) of the one family held."""
    (family,) = {b.family for b in conversations.branches()}
    return len(family.branches), len(family.owner), len(family.ends)


async def _trunk(conversations: Conversations) -> list[dict[str, Any]]:
    """A first conversation whose first result is replaced, gone on a round past it; its
    first three messages (where forks go their own way)."""
    start = [user("task"), call("t1"), answer("t1", "a" * 5_000)]
    await send(conversations, start)
    await send(conversations, [*start, call("t2"), answer("t2", "ok")])
    return start


def test_forks_of_one_conversation_are_held_up_to_the_bound_and_freed_past_it(
    tmp_path: Path,
) -> None:
    """Sixty forks of one conversation: at most ``max_branches`` are held at any time, the
    family's index stays that size, and each fork let go is freed at once."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=4)
        await send(conversations, [user("root")])
        gone: list[weakref.ref[Branch]] = []
        for k in range(60):
            branch, _ = await send(conversations, [user("root"), OK, user(f"v{k}")])
            gone.append(weakref.ref(branch))
            branches, prefixes, ends = _family_index(conversations)
            assert conversations.held == branches <= 4
            assert prefixes <= 4 * 3 and ends <= 4
        held = {id(b) for b in conversations.branches()}
        alive = [b for r in gone if (b := r()) is not None]  # without the collector
        assert alive and all(id(b) in held for b in alive)
        assert any(b.name is None for b in conversations.branches())  # its first stays

    gc.disable()
    try:
        anyio.run(main)
    finally:
        gc.enable()


def test_forks_of_one_conversation_are_held_within_the_held_size(tmp_path: Path) -> None:
    """The held size bounds one family's forks too: past it, with no other family to let go,
    its least recently routed forks are let go (its first conversation stays)."""

    async def main() -> None:
        conversations = registry(tmp_path, max_held_bytes=3_000)
        await send(conversations, [user("root")], size=1_000)
        for k in range(12):
            await send(conversations, [user("root"), OK, user(f"v{k}")], size=1_000)
            assert conversations.held_bytes <= 3_000 and conversations.held <= 3
        assert any(b.name is None for b in conversations.branches())

    anyio.run(main)


def test_a_fork_let_go_comes_back_byte_for_byte(tmp_path: Path) -> None:
    """A fork let go past ``max_branches`` is made again by its name when a request of it
    comes back, and its records fill it: its results go as they went (the same replacement,
    the same path)."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=2)
        start = await _trunk(conversations)
        fork_b = [*start, call("t3"), answer("t3", "b" * 5_000)]
        first_b, sent_b = await send(conversations, fork_b)
        assert first_b.name is not None
        assert sent_b[4]["content"][0]["content"].startswith(TAG)
        await send(conversations, [*start, call("t4"), answer("t4", "c" * 5_000)])
        assert first_b not in conversations.branches()  # the least recently routed went
        again, resent = await send(conversations, [*fork_b, call("t5"), answer("t5", "ok")])
        assert again is not first_b and again.name == first_b.name
        assert resent[:5] == sent_b  # the same bytes, the replacement and its path included
        assert conversations.held == 2

    anyio.run(main)


def test_a_fork_made_again_by_its_name_takes_its_own_token_calibration(tmp_path: Path) -> None:
    """A fork let go and made again starts from the token calibration it saved, as a
    conversation loaded again does, not from its parent's."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=2)
        start = await _trunk(conversations)
        fork = [*start, call("t3"), answer("t3", "b" * 20_000)]
        first, _ = await send(conversations, fork)
        await first.session.save_calibration()
        saved = first.session.ctx.token_tracker.state_dict()
        await send(conversations, [*start, call("t4"), answer("t4", "c")])
        assert first not in conversations.branches()
        request = body([*fork, call("t5"), answer("t5", "ok")])
        again = await conversations.route(request, KEY_A)
        parent = next(b for b in conversations.branches() if b.name is None)
        assert again.name == first.name
        assert again.session.ctx.token_tracker.state_dict() == saved
        assert saved != parent.session.ctx.token_tracker.state_dict()

    anyio.run(main)


def test_a_fork_let_go_while_a_fork_of_it_is_held_comes_back_by_its_name(
    tmp_path: Path,
) -> None:
    """X forks from the first conversation, Y from X; X is let go. What X sent up to where Y
    went its own way Y sent too: X's request still comes back to X (by its name, its records
    filling it), not to a new fork of Y that would send X's replaced result whole."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=3)
        start = await _trunk(conversations)
        x_messages = [*start, call("x1"), answer("x1", "b" * 10)]
        x, _ = await send(conversations, x_messages)
        x_messages += [call("x2"), answer("x2", "c" * 5_000)]
        _, sent_x = await send(conversations, x_messages)
        assert sent_x[6]["content"][0]["content"].startswith(TAG)
        y_messages = [*start, call("x1"), answer("x1", "b" * 10), call("y1"), answer("y1", "y")]
        await send(conversations, y_messages)
        await send(
            conversations, [*start, call("t2"), answer("t2", "ok"), call("t3"), answer("t3", "ok")]
        )
        await send(conversations, [*start, call("z1"), answer("z1", "z")])
        assert x not in conversations.branches()
        again, resent = await send(conversations, [*x_messages, call("x3"), answer("x3", "ok")])
        assert again.name == x.name
        assert resent[:7] == sent_x

    anyio.run(main)


def test_a_fork_let_go_never_goes_to_the_conversation_it_forked_from(tmp_path: Path) -> None:
    """The first conversation rewinds to where X went its own way, then X is let go: X's next
    request extends the first conversation's last, yet X sent what follows -- it goes to X."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=2)
        start = [user("task"), call("t1"), answer("t1", "ok")]
        first, _ = await send(conversations, start)
        await send(conversations, [*start, call("t2"), answer("t2", "ok")])
        x_messages = [*start, call("x1"), answer("x1", "b" * 5_000)]
        x, sent_x = await send(conversations, x_messages)
        assert sent_x[4]["content"][0]["content"].startswith(TAG)
        assert (await send(conversations, start))[0] is first  # rewound to where X parted
        await send(conversations, [user("task"), call("q"), answer("q", "q")])
        assert x not in conversations.branches()
        again, resent = await send(conversations, [*x_messages, call("x2"), answer("x2", "ok")])
        assert again.name == x.name and again is not first
        assert resent[:5] == sent_x

    anyio.run(main)


def test_a_family_loads_its_first_conversation_and_the_forks_written_last(
    tmp_path: Path,
) -> None:
    """A new process holds of a family with more forks than ``max_branches`` on disk its first
    conversation and those written last; the others come back by name when asked for."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=8)
        await send(conversations, [user("root")])
        names: list[str | None] = []
        for k in range(6):
            branch, _ = await send(conversations, [user("root"), OK, user(f"v{k}")])
            names.append(branch.name)
        # the first fork is the first conversation grown, the others its forks
        assert names[0] is None and all(names[1:])
        stamp = 1_000_000_000
        for k, name in enumerate(names[1:]):  # written in the order they were made
            path = next(tmp_path.rglob(f"decisions.{name}.jsonl"))
            os.utime(path, (stamp + k, stamp + k))
        fresh = registry(tmp_path, max_branches=3)
        branch, _ = await send(fresh, [user("root"), OK, user("v5")])
        loaded = {b.name for b in fresh.branches()}
        assert loaded == {None, names[4], names[5]}
        old, _resent = await send(fresh, [user("root"), OK, user("v1")])
        assert old.name == names[1] and fresh.held == 3

    anyio.run(main)


@pytest.mark.parametrize("max_branches", [2, 8])
def test_a_retry_of_a_fork_let_go_goes_to_the_fork_whose_last_request_it_is(
    tmp_path: Path, max_branches: int
) -> None:
    """A retry goes to the conversation whose last request it is, held or let go, before
    the one that sent that prefix first: alike whatever was let go."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=max_branches)
        await send(conversations, [user("task"), call("t0"), answer("t0", "0" * 5_000)])
        x = [user("task"), call("t1"), answer("t1", "1" * 5_000)]
        await send(conversations, x)
        third = [*x, call("t2"), answer("t2", "2" * 1_500)]
        await send(conversations, third)
        await send(conversations, [*third, call("t3"), answer("t3", "3")])
        await send(conversations, [*x, call("t4"), answer("t4", "4" * 1_500)])
        retried, _ = await send(conversations, x)
        await send(conversations, [*third, call("t3"), answer("t3", "3")])
        again, _ = await send(conversations, x)
        assert again.name == retried.name

    anyio.run(main)


def test_a_line_that_goes_on_from_a_fork_let_go_keeps_that_forks_decisions(
    tmp_path: Path,
) -> None:
    """Two lines extended one fork, the second took it over, then the fork was let go: the
    first line going on is a fork of a conversation not held, and takes what that one
    decided on the results they share from its records -- the same bytes as before."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=2)
        await send(conversations, [user("task"), call("t0"), answer("t0", "0")])
        f1 = [user("task"), call("t1"), answer("t1", "1" * 5_000)]
        await send(conversations, f1)
        line = [user("task"), call("t2"), answer("t2", "2" * 5_000)]
        _, sent = await send(conversations, line)
        assert sent[2]["content"][0]["content"].startswith(TAG)
        await send(conversations, [*line, call("t3"), answer("t3", "3" * 1_500)])
        await send(conversations, [*f1, call("t4"), answer("t4", "4" * 1_500)])
        _, resent = await send(conversations, [*line, call("t5"), answer("t5", "5")])
        assert resent[:3] == sent

    anyio.run(main)


def test_after_a_restart_a_fork_not_loaded_gets_its_requests_with_its_bytes(
    tmp_path: Path,
) -> None:
    """A new process loads a family's first conversation and the forks written last, and
    reads what the others sent: a request of one not loaded goes to it, by its name, its
    results as they went -- not to the first conversation, whose last request it extends."""

    async def main() -> None:
        conversations = registry(tmp_path, max_branches=8)
        start = [user("task"), call("t1"), answer("t1", "ok")]
        first, _ = await send(conversations, start)
        await send(conversations, [*start, call("t2"), answer("t2", "ok")])
        forks = []
        for k in range(5):
            fork = [*start, call(f"x{k}"), answer(f"x{k}", f"{k}" * 5_000)]
            branch, sent = await send(conversations, fork)
            assert branch.name is not None and sent[4]["content"][0]["content"].startswith(TAG)
            forks.append((fork, branch.name, sent))
        assert (await send(conversations, start))[0] is first  # back to where they parted
        fresh = registry(tmp_path, max_branches=2)
        for fork, name, sent in forks[:3]:
            again, resent = await send(fresh, [*fork, call("n"), answer("n", "ok")])
            assert again.name == name
            assert resent[:5] == sent

    anyio.run(main)


@pytest.mark.parametrize("bound", [1, 0, True, 2.5])
def test_a_branch_bound_below_two_is_refused(tmp_path: Path, bound: Any) -> None:
    with pytest.raises(ValueError, match="max_branches must be an integer of at least 2"):
        registry(tmp_path, max_branches=bound)


def test_wrap_takes_the_branch_bound(tmp_path: Path) -> None:
    import anthropic

    from pipeline import Pipeline
    from pipeline.dropin.wrap import wrap

    client = anthropic.Anthropic(api_key="sk-ant-x", base_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="max_branches must be an integer of at least 2"):
        wrap(client, root=tmp_path, pipeline=lambda: Pipeline([]), max_branches=1)
    wrap(client, root=tmp_path, pipeline=lambda: Pipeline([]), max_branches=2)


def test_the_records_of_a_fork_not_held_are_read_off_the_event_loop(tmp_path: Path) -> None:
    """A fork of a fork let go reads what that one decided from its records: on an object
    store that is a read over the network, made in a worker thread, never on the event loop
    that serves every other request."""
    from obstore.store import MemoryStore

    from pipeline.store.sessions import SessionStates
    from tests.objectstore_support import Wrapped

    loop_thread: list[int] = []
    on_loop: list[str] = []

    def read(path: str | None, **_kw: Any) -> None:
        if loop_thread and threading.get_ident() == loop_thread[0]:
            on_loop.append(str(path))

    store = Wrapped(MemoryStore(), before={"get": read, "list": read})
    states = SessionStates("memory:///conv", object_store=store, cool_down=None)

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        conversations = registry(tmp_path, max_branches=2, storage=states)
        await send(conversations, [user("task"), call("t0"), answer("t0", "0")])
        f1 = [user("task"), call("t1"), answer("t1", "1" * 5_000)]
        await send(conversations, f1)
        line = [user("task"), call("t2"), answer("t2", "2" * 5_000)]
        _, sent = await send(conversations, line)
        await send(conversations, [*line, call("t3"), answer("t3", "3" * 1_500)])
        await send(conversations, [*f1, call("t4"), answer("t4", "4" * 1_500)])
        before = store.calls.get("list", 0)
        _, resent = await send(conversations, [*line, call("t5"), answer("t5", "5")])
        assert resent[:3] == sent
        assert store.calls.get("list", 0) > before  # the fork's records were read

    anyio.run(main)
    assert on_loop == []
