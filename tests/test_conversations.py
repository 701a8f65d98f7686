"""Which conversation a request belongs to (``pipeline.dropin.conversations``), in process: placed
by
tenant and by the messages it begins with, never by a name alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline import Pipeline
from pipeline.dropin.conversations import Branch, Conversations, conversation_hint
from pipeline.dropin.tenancy import Tenancy
from pipeline.store.sessions import SessionStates
from pipeline.testing import QuietLogger
from stages import ToolResultBudget
from tests.wire_support import TAG, OffTheLoop

KEY_A = {"x-api-key": "sk-ant-A"}
KEY_B = {"x-api-key": "sk-ant-B"}


def registry(root: Path, **options: Any) -> Conversations:
    return Conversations(
        pipeline=lambda: Pipeline([ToolResultBudget(3_000)]),
        root=root,
        logger=QuietLogger(),
        **options,
    )


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text, **extra}]}


def call(tid: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": tid, "name": "Bash", "input": {}}],
    }


def answer(tid: str, output: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": tid, "content": output}],
    }


def body(messages: list[dict[str, Any]], system: Any = "you help") -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "system": system, "messages": messages}


async def send(
    conversations: Conversations,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
    size: int | None = None,
    **extra: Any,
) -> tuple[Branch, list[Any]]:
    """Route and prepare one request (``size``: what the index counts it as); the response
    observed as the API would answer it."""
    request = body(messages, **extra)
    branch = await conversations.route(request, headers or KEY_A, size=size)
    prepared = await branch.session.prepare_request(request)
    usage = {"input_tokens": 100 + len(messages), "output_tokens": 5}
    await branch.session.observe_async(f"msg_{len(messages)}", usage, "m")
    return branch, prepared["messages"]


def test_a_growing_conversation_stays_one_and_its_first_call_joins_it(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path)
        # Claude Code marks the first message while it is the only one, never after
        first, _ = await send(conversations, [user("go", cache_control={"type": "ephemeral"})])
        history = [user("go"), call("t1"), answer("t1", "x" * 5_000)]
        second, sent = await send(conversations, history)
        history += [call("t2"), answer("t2", "y" * 100)]
        third, again = await send(conversations, history)
        assert first is second is third
        assert again[:3] == sent  # the replacement re-applied byte for byte
        assert sent[2]["content"][0]["content"].startswith(TAG)
        # the first call's response id reached the conversation: its answer carries it
        assert third.session._records[1].message_id == "msg_1"
        assert len(conversations.branches()) == 1

    anyio.run(main)


def test_alike_openings_that_go_different_ways_are_two_conversations(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path)
        a_history = [user("run the build"), call("toolu_1"), answer("toolu_1", "A-SECRET " * 800)]
        b_history = [user("run the build"), call("toolu_1"), answer("toolu_1", "hello from B")]
        a, a_sent = await send(conversations, a_history)
        b, b_sent = await send(conversations, b_history)
        assert a is not b
        assert a_sent[2]["content"][0]["content"].startswith(TAG)
        assert b_sent[2]["content"][0]["content"] == "hello from B"
        # each continues as its own, in any order
        a2, _ = await send(conversations, [*a_history, call("t2"), answer("t2", "a")])
        b2, b2_sent = await send(conversations, [*b_history, call("t2"), answer("t2", "b")])
        assert (a2, b2) == (a, b)
        assert "A-SECRET" not in json.dumps(b2_sent)

    anyio.run(main)


@pytest.mark.parametrize("fork_first", [False, True])
def test_a_fork_sends_its_parents_bytes(tmp_path: Path, fork_first: bool) -> None:
    """Claude Code's fork: the parent's messages, the launching call without its text, then
    the fork's directive; the parent goes on with the whole call and its result."""

    async def main() -> None:
        conversations = registry(tmp_path)
        history = [user("review"), call("t1"), answer("t1", "log " * 2_000)]
        system = [{"type": "text", "text": "you help"}]
        await send(conversations, history, system=system)  # its output new: persisted
        history += [call("t2"), answer("t2", "ok")]
        _, parent_sent = await send(conversations, history, system=system)
        launch = {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "I'll fork."},
                {"type": "tool_use", "id": "ag", "name": "Agent", "input": {}},
            ],
        }
        fork_history = [
            *history,
            {"role": "assistant", "content": launch["content"][1:]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "ag", "content": "Fork started"},
                    {"type": "text", "text": "Your directive: check the tests"},
                ],
            },
        ]
        parent_next = [*history, launch, answer("ag", "Async agent launched")]
        billing = "x-anthropic-billing-header: cc_is_subagent=true;"
        order = [(fork_history, billing), (parent_next, None)]
        if not fork_first:
            order.reverse()
        sent = {}
        for messages, header in order:
            system = [{"type": "text", "text": header}] if header else None
            system_blocks = [*(system or []), {"type": "text", "text": "you help"}]
            branch, out = await send(conversations, messages, system=system_blocks)
            sent[id(messages)] = (branch, out)
        fork, fork_sent = sent[id(fork_history)]
        main, main_sent = sent[id(parent_next)]
        assert fork is not main
        assert fork_sent[: len(parent_sent)] == parent_sent  # the parent's bytes
        assert main_sent[: len(parent_sent)] == parent_sent
        files = list(tmp_path.rglob("tool-results/*"))
        assert len(files) == 1  # the inherited result was not persisted again

    anyio.run(main)


def test_a_retry_of_an_earlier_request_is_the_same_conversation(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path)
        short = [user("go"), call("t1"), answer("t1", "q" * 4_000)]
        longer = [*short, call("t2"), answer("t2", "r")]
        first, short_sent = await send(conversations, short)
        await send(conversations, longer)
        retried, again = await send(conversations, short)
        assert retried is first and again == short_sent
        assert len(conversations.branches()) == 1

    anyio.run(main)


def test_tenants_never_meet_and_one_tenant_is_a_switch(tmp_path: Path) -> None:
    async def main() -> None:
        history = [user("build"), call("toolu_b"), answer("toolu_b", "B-SECRET " * 800)]
        mine = [user("build"), call("toolu_b"), answer("toolu_b", "mine")]
        conversations = registry(tmp_path / "apart")
        b, _ = await send(
            conversations,
            history,
            KEY_B,
        )
        a, a_sent = await send(conversations, mine, {**KEY_A, "x-sluicegate-session": "x"})
        a2, _ = await send(conversations, mine, KEY_A)
        assert b.family.tenant != a.family.tenant and a is not b and a2 is not b
        assert a_sent[2]["content"][0]["content"] == "mine"
        # nothing of a tenant's lies under another's directory
        tenants = [d for d in (tmp_path / "apart").iterdir() if d.is_dir()]
        assert len(tenants) == 2
        holding = [d.name for d in tenants if "B-SECRET" in _all_text(d)]
        assert holding == [b.family.tenant]
        # a credential is never written down
        assert "sk-ant" not in _all_text(tmp_path / "apart")

        single = registry(tmp_path / "one", tenancy=Tenancy(single=True))
        x, _ = await send(single, history, KEY_B)
        y, _ = await send(single, history, KEY_A)
        assert x is y and x.family.tenant == "shared"

    anyio.run(main)


def _all_text(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


def test_a_new_process_places_requests_as_the_last_one_did(tmp_path: Path) -> None:
    async def main() -> None:
        history = [user("go"), call("t1"), answer("t1", "p" * 4_000)]
        history += [call("t2"), answer("t2", "ok")]
        fork_history = [*history[:3], call("t9"), answer("t9", "f" * 4_000)]
        first = registry(tmp_path)
        parent, parent_sent = await send(first, history)
        fork, fork_sent = await send(first, fork_history)
        assert fork is not parent

        again = registry(tmp_path)  # only the disk is left
        p2, p2_sent = await send(again, [*history, call("t3"), answer("t3", "s")])
        f2, f2_sent = await send(again, [*fork_history, call("t4"), answer("t4", "u")])
        assert p2.conversation_id == parent.conversation_id
        assert f2.conversation_id == fork.conversation_id
        assert p2_sent[: len(parent_sent)] == parent_sent
        assert f2_sent[: len(fork_sent)] == fork_sent

    anyio.run(main)


def test_explicit_hints_keep_alike_conversations_apart(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path)
        history = [user("same start")]
        one = await conversations.route(body(history), {**KEY_A, "x-sluicegate-session": "one"})
        two = await conversations.route(body(history), {**KEY_A, "x-sluicegate-session": "two"})
        assert one is not two
        assert one.conversation_id.startswith("one-") and two.conversation_id.startswith("two-")
        with pytest.raises(ValueError, match="session_id"):
            await conversations.route(body(history), {"x-sluicegate-session": "../x"})

    anyio.run(main)


def test_the_hint_is_only_a_hint() -> None:
    session = "de804c2f-1e20-4494-bd5b-ba955b3f60f1"
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": session})
    request = body([user("hi")])
    assert conversation_hint({**request, "metadata": {"user_id": user_id}}) == f"cc-{session}"
    assert conversation_hint(request) == ""


# -- found by review: each failed before its fix ------------------------------------------------


class EchoSummarizer:
    """Stands for a model: the summary repeats what the conversation said."""

    async def summarize(self, messages: list[Any]) -> str:
        texts = []
        for m in messages:
            content = m["content"]
            for b in [{"type": "text", "text": content}] if isinstance(content, str) else content:
                if b.get("type") == "text" and len(b["text"]) < 200:
                    texts.append(b["text"])
        return "Summary: " + " | ".join(texts)


def test_a_branch_never_sends_its_parents_summary(tmp_path: Path) -> None:
    """The parent compacted a part the branch does not share; the branch's messages after
    its own way equal the parent's there (same position, same text): the parent's summary,
    which holds the parent's content, must not stand in for the branch's history."""
    from stages import Autocompact

    def make() -> Pipeline:
        compact = Autocompact(
            EchoSummarizer(), context_window=30_000, max_output_tokens=1_000, buffer_tokens=3_000
        )
        return Pipeline([ToolResultBudget(200_000), compact])

    async def main() -> None:
        conversations = Conversations(pipeline=make, root=tmp_path, logger=QuietLogger())
        big = user("context: " + "lorem ipsum " * 10_000)
        said = [big, {"role": "assistant", "content": "sure"}]
        await send(conversations, [big])
        branch = conversations.branches()[0]
        await branch.session.observe_async("msg_big", {"input_tokens": 30_000}, "m")
        tail = [{"role": "assistant", "content": "ok"}, user("continue")]
        _, parent_sent = await send(conversations, [*said, user("PARENT-SECRET 0000"), *tail])
        assert "PARENT-SECRET" in json.dumps(parent_sent)  # the parent's own summary
        _, fork_sent = await send(conversations, [*said, user("the fork's question"), *tail])
        assert "PARENT-SECRET" not in json.dumps(fork_sent)

    anyio.run(main)


def _faulty_states(fail: Any) -> Any:
    from obstore.store import MemoryStore

    from pipeline.store.sessions import SessionStates
    from tests.objectstore_support import Wrapped

    # a fault each time asked (no cool-down): these tests aim one fault at one write
    store = Wrapped(MemoryStore(), before=fail)
    return SessionStates("memory:///conv", object_store=store, cool_down=None)


@pytest.mark.parametrize("fault", ["fork record", "damaged fork record"])
def test_a_branch_keeps_what_it_inherited_across_a_restart(tmp_path: Path, fault: str) -> None:
    """Its fork record could not be written (the record of its first response carries it), or
    it was damaged on disk (one bad digest): after a restart the shared part still goes out as
    the parent sent it."""
    failing = {"on": True}

    def put(path: str, data: bytes, **_kw: Any) -> None:
        if fault == "fork record" and failing["on"] and b'"stage": "wire_session.fork"' in data:
            raise OSError(5, "I/O error")

    states = _faulty_states({"put": put})

    async def main() -> None:
        history = [
            user("go"),
            call("t1"),
            answer("t1", "p" * 4_000),
            call("t2"),
            answer("t2", "ok"),
        ]
        fork_history = [*history[:3], call("t9"), answer("t9", "f")]
        first = registry(tmp_path, storage=states)
        await send(first, history[:3])  # its output new: persisted
        await send(first, history)
        fork, fork_sent = await send(first, fork_history)
        assert fork_sent[2]["content"][0]["content"].startswith(TAG)
        failing["on"] = False
        if fault == "damaged fork record":
            store = states._store
            (key,) = [
                m["path"] for c in store.list() for m in c
                if bytes(store.get(m["path"]).bytes()).find(b"wire_session.fork") >= 0
            ]  # fmt: skip
            raw = json.loads(bytes(store.get(key).bytes()))
            raw["data"]["chain"][-1] = "zz"
            store.inner.put(key, (json.dumps(raw) + "\n").encode())
        again = registry(tmp_path, storage=states)
        later, later_sent = await send(again, [*fork_history, call("t4"), answer("t4", "u")])
        assert later.conversation_id == fork.conversation_id
        assert later_sent[: len(fork_sent)] == fork_sent

    anyio.run(main)


def test_a_failed_response_record_leaves_the_chain_right_for_a_new_process(
    tmp_path: Path,
) -> None:
    failing = {"on": False}

    def put(path: str, data: bytes, **_kw: Any) -> None:
        if failing["on"] and b"wire_session.response" in data:
            raise OSError(28, "No space left on device")

    states = _faulty_states({"put": put})

    async def main() -> None:
        first = registry(tmp_path, storage=states)
        history = [user("go"), call("t1"), answer("t1", "a")]
        for step in range(2, 6):
            failing["on"] = step == 2
            history += [call(f"t{step}"), answer(f"t{step}", "b")]
            branch, _ = await send(first, history)
        again = registry(tmp_path, storage=states)
        (loaded,) = (await again.route(body(history[:3]), KEY_A)).family.branches.values()
        assert loaded.session.chain == branch.chain  # every message the conversation sent

    anyio.run(main)


def test_a_fork_with_no_response_yet_is_placed_alike_after_a_restart(tmp_path: Path) -> None:
    async def scenario(root: Path, restart: bool) -> list[str]:
        short = [user("go"), call("t1"), answer("t1", "p" * 4_000)]
        history = [*short, call("t2"), answer("t2", "ok")]
        conversations = registry(root)
        await send(conversations, short)
        await send(conversations, history)
        fork = await conversations.route(body([*short, call("t9"), answer("t9", "f")]), KEY_A)
        await fork.session.prepare_request(body([*short, call("t9"), answer("t9", "f")]))
        if restart:  # the fork's call failed upstream: no response recorded
            conversations = registry(root)
        retry, _ = await send(conversations, short)
        edit, _ = await send(conversations, [*short, call("t7"), answer("t7", "e")])
        return [retry.conversation_id, edit.conversation_id]

    live = anyio.run(scenario, tmp_path / "live", False)
    restarted = anyio.run(scenario, tmp_path / "restarted", True)
    assert [n.split("-", 1)[1] for n in live] == [n.split("-", 1)[1] for n in restarted]


def test_a_pruned_result_name_never_holds_another_output(tmp_path: Path) -> None:
    """Results a family's conversations share are named by their content: once retention has
    removed one, another output with the same id never takes its name."""
    from datetime import timedelta

    from pipeline.store.retention import prune_store

    async def main() -> None:
        conversations = registry(tmp_path)
        _, a_sent = await send(
            conversations, [user("go"), call("toolu_1"), answer("toolu_1", "A" * 4_000)]
        )
        prune_store(tmp_path, max_age=timedelta(0))
        _, b_sent = await send(
            conversations, [user("go"), call("toolu_1"), answer("toolu_1", "B" * 4_000)]
        )

        def path_of(sent: list[Any]) -> str:
            return str(sent[2]["content"][0]["content"].split("saved to: ")[1].split("\n")[0])

        assert path_of(a_sent) != path_of(b_sent)
        assert Path(path_of(b_sent)).read_text() == "B" * 4_000
        assert not Path(path_of(a_sent)).exists()  # removed: a read fails, never another's

    anyio.run(main)


def test_a_branch_starts_with_its_parents_responses(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path)
        await send(conversations, [user("go")])  # answered by msg_1: the call of t1
        short = [user("go"), call("t1"), answer("t1", "x")]
        await send(conversations, [*short, call("t2"), answer("t2", "y")])
        fork, _ = await send(conversations, [*short, call("t9"), answer("t9", "z")])
        # the shared answer (message 3 of the fork is its own): the parent's response id
        assert fork.session._records[1].message_id == "msg_1"

    anyio.run(main)


def test_responses_observed_at_once_leave_the_chain_a_new_process_reads(tmp_path: Path) -> None:
    """Two calls of one conversation in flight (a retry of an earlier request and the next
    one), their responses observed at the same time: each recorded where it answers, and the
    chain on disk the one this process places by."""

    async def main() -> None:
        conversations = registry(tmp_path)
        start = [user("go"), call("t1"), answer("t1", "a"), call("t2"), answer("t2", "b")]
        branch, _ = await send(conversations, start)
        retry, onward = start[:3], [*start, call("t3"), answer("t3", "c")]
        session = branch.session
        calls = []
        for messages in (retry, onward):
            assert await conversations.route(body(messages), KEY_A) is branch
            calls.append((await session.prepare_call(body(messages)))[1])
        usage = {"input_tokens": 5, "output_tokens": 1}
        async with anyio.create_task_group() as tasks:
            for name, made in zip(("msg_retry", "msg_onward"), calls, strict=True):
                tasks.start_soon(
                    lambda n=name, c=made: session.observe_async(n, usage, "m", call=c)
                )
        assert session._responses[3][0] == "msg_retry" and session._responses[7][0] == "msg_onward"
        later = [*onward, {"role": "assistant", "content": "done"}, user("next")]
        await send(conversations, later)
        fresh = registry(tmp_path)
        family = fresh._load_family(branch.family.tenant, branch.family.name, branch.family.opening)
        (loaded,) = family.branches.values()
        assert loaded.session.chain == session.chain

    anyio.run(main)


@pytest.mark.parametrize("observed", [False, True])
def test_a_retry_after_a_restart_keeps_every_decision(tmp_path: Path, observed: bool) -> None:
    """After a restart the first request may be a retry of an earlier one, without a result
    the conversation decided on; the decision stands for when that result comes again (in the
    conversation, or in a branch of it). ``observed=False``: the retried conversation's only
    call got no response (nothing told where it ends) and another that opens alike comes."""

    async def main() -> None:
        first = registry(tmp_path)
        history = [user("go"), call("t1"), answer("t1", "p" * 4_000)]
        request = body(history)
        branch = await first.route(request, KEY_A)
        sent, _ = await branch.session.prepare_call(request)
        if observed:
            await branch.session.observe_async("msg_3", {"input_tokens": 9}, "m")
        again = registry(tmp_path)  # only the disk is left
        await send(again, history[:1])  # the retry (or the other conversation)
        _, later = await send(again, history)
        assert later == sent["messages"]  # the replacement as it was sent
        _, fork = await send(again, [*history, call("t9"), answer("t9", "f")])
        assert fork[:3] == sent["messages"]

    anyio.run(main)


def test_a_fork_record_that_cannot_be_written_is_never_lost_to_its_own_records(
    tmp_path: Path,
) -> None:
    """The fork record fails, and so does the record of the first response: the branch's
    next call still holds what it inherited (its own budget records are not another worker's
    branch), in this process and after a restart."""
    failing = {"on": True}

    def put(path: str, data: bytes, **_kw: Any) -> None:
        if failing["on"] and (b"wire_session.fork" in data or b"wire_session.response" in data):
            raise OSError(5, "I/O error")

    states = _faulty_states({"put": put})

    async def main() -> None:
        history = [user("go"), call("t1"), answer("t1", "p" * 4_000)]
        history += [call("t2"), answer("t2", "ok")]
        fork_history = [*history[:3], call("t9"), answer("t9", "f" * 4_000)]
        conversations = registry(tmp_path, storage=states)
        failing["on"] = False
        await send(conversations, history)
        failing["on"] = True
        _, fork_sent = await send(conversations, fork_history)
        failing["on"] = False
        _, next_sent = await send(conversations, [*fork_history, call("t4"), answer("t4", "u")])
        assert next_sent[: len(fork_sent)] == fork_sent
        again = registry(tmp_path, storage=states)
        _, after = await send(again, [*fork_history, call("t5"), answer("t5", "v")])
        assert after[: len(fork_sent)] == fork_sent

    anyio.run(main)


def test_a_retry_of_a_conversations_start_never_takes_a_branch_that_goes_further(
    tmp_path: Path,
) -> None:
    """A conversation's first request is sent again (a retry) after a branch went further from
    it; the branch's own last request, sent again, is still the branch's -- not the first
    conversation's, whose last request (the retry) it also extends."""

    async def main() -> None:
        conversations = registry(tmp_path)
        start = [user("go"), {"role": "assistant", "content": "forked"}, user("directive")]
        first, _ = await send(conversations, start)
        await send(conversations, start[:1])  # another client opening alike: a retry of [go]
        await send(conversations, [user("go"), call("t0"), answer("t0", "small")])
        longer = [*start, call("t2"), answer("t2", "y" * 4_000)]
        branch, sent = await send(conversations, longer)
        assert branch is not first
        retry, _ = await send(conversations, start)
        assert retry is first
        again, sent_again = await send(conversations, longer)
        assert again is branch and sent_again == sent

    anyio.run(main)


def test_conversations_past_the_bound_are_let_go_and_come_back_byte_for_byte(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        conversations = registry(tmp_path, max_held=2)
        a = [user("task A"), call("t1"), answer("t1", "a" * 5_000)]
        first, sent = await send(conversations, a)
        assert sent[2]["content"][0]["content"].startswith(TAG)
        for opening in ("task B", "task C"):
            await send(conversations, [user(opening)])
        assert conversations.held == 2
        assert first not in conversations.branches()  # the least recently routed to went
        a += [call("t2"), answer("t2", "b" * 100)]
        again, resent = await send(conversations, a)
        assert again is not first  # loaded from its records again
        assert again.conversation_id == first.conversation_id
        assert resent[:3] == sent  # the same bytes, the replacement and its path included
        assert conversations.held == 2

    anyio.run(main)


def test_a_conversation_in_a_call_is_never_let_go(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path, max_held=1)
        busy, _ = await send(conversations, [user("task A")])
        async with busy.call_lock:  # the proxy holds it across the call
            await send(conversations, [user("task B")])
            assert busy in conversations.branches()
            assert conversations.held == 2  # over the bound while the call lasts
        await send(conversations, [user("task C")])
        assert busy not in conversations.branches()
        assert conversations.held == 1

    anyio.run(main)


@pytest.mark.parametrize("bound", [0, -3])
def test_a_bound_below_one_is_refused(tmp_path: Path, bound: int) -> None:
    with pytest.raises(ValueError, match="max_held must be at least 1"):
        registry(tmp_path, max_held=bound)


@pytest.mark.parametrize("bound", [0, -3])
def test_a_held_size_below_one_is_refused(tmp_path: Path, bound: int) -> None:
    with pytest.raises(ValueError, match="max_held_bytes must be at least 1"):
        registry(tmp_path, max_held_bytes=bound)


def _held_sizes(conversations: Conversations) -> int:
    return sum(b.size for b in conversations.branches())


def test_conversations_past_the_held_size_are_let_go_and_come_back_byte_for_byte(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        conversations = registry(tmp_path, max_held_bytes=1_000)
        a = [user("task A"), call("t1"), answer("t1", "a" * 5_000)]
        first, sent = await send(conversations, a, size=400)
        await send(conversations, [user("task B")], size=400)
        assert conversations.held == 2 and conversations.held_bytes == 800
        await send(conversations, [user("task C")], size=400)  # 1,200: past the bound
        assert conversations.held == 2 and conversations.held_bytes == 800
        assert first not in conversations.branches()  # the least recently routed to went
        a += [call("t2"), answer("t2", "b" * 100)]
        again, resent = await send(conversations, a, size=450)
        assert again is not first and again.conversation_id == first.conversation_id
        assert resent[:3] == sent  # the same bytes, the replacement and its path included
        assert conversations.held_bytes == 850 == _held_sizes(conversations)

    anyio.run(main)


def test_a_conversation_that_grows_past_the_held_size_lets_the_others_go(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path, max_held_bytes=1_000)
        a = [user("task A")]
        first, _ = await send(conversations, a, size=300)
        growing, _ = await send(conversations, [user("task B")], size=300)
        again, _ = await send(
            conversations, [user("task B"), call("t1"), answer("t1", "x")], size=900
        )
        assert again is growing and first not in conversations.branches()
        assert conversations.held == 1 and conversations.held_bytes == 900
        # the conversation routed to stays, alone over the bound
        await send(
            conversations, [user("task B"), call("t1"), answer("t1", "x"), user("go")], size=5_000
        )
        assert conversations.held == 1 and conversations.held_bytes == 5_000

    anyio.run(main)


def test_a_conversation_in_a_call_is_never_let_go_for_its_size(tmp_path: Path) -> None:
    async def main() -> None:
        conversations = registry(tmp_path, max_held_bytes=1_000)
        busy, _ = await send(conversations, [user("task A")], size=800)
        async with busy.call_lock:
            await send(conversations, [user("task B")], size=800)
            assert busy in conversations.branches()
            assert conversations.held_bytes == 1_600  # over the bound while the call lasts
        await send(conversations, [user("task C")], size=100)
        assert busy not in conversations.branches()
        assert conversations.held_bytes == 900 == _held_sizes(conversations)

    anyio.run(main)


def test_the_held_size_is_what_the_conversations_held_last_sent(tmp_path: Path) -> None:
    """Across conversations, branches of one family, growth, sizes not given and both
    bounds at work: the index's count is the sum over the conversations it holds, and it
    never stays past the bound once nothing is in a call."""
    import random

    rng = random.Random(7)

    async def main() -> None:
        gone: list[Branch] = []
        conversations = registry(tmp_path, max_held=4, max_held_bytes=3_000, on_let_go=gone.append)
        histories: dict[str, list[dict[str, Any]]] = {}
        for step in range(160):
            opening = f"task {rng.randrange(6)}"
            history = histories.setdefault(opening, [user(opening)])
            if rng.random() < 0.2 and len(history) > 1:  # a branch: the same opening, another way
                history = histories[opening] = history[:1]
            history += [call(f"t{step}"), answer(f"t{step}", "r" * rng.randrange(1, 300))]
            size = None if rng.random() < 0.1 else rng.randrange(1, 1_500)
            branch, _ = await send(conversations, list(history), size=size)
            assert conversations.held_bytes == _held_sizes(conversations)
            within = conversations.held <= 4 and conversations.held_bytes <= 3_000
            # past a bound, only the family just routed to is left (it is never let go), and
            # of it no more than its first conversation, the one routed to and busy ones
            held = conversations.branches()
            assert within or all(b.family is branch.family for b in held)
            assert within or all(b is branch or b.name is None for b in held)

        # the bounds were at work: conversations let go, whole families and forks of one
        assert len(gone) > 20
        assert any(b.name is not None for b in gone) and any(b.name is None for b in gone)

    anyio.run(main)


def test_loading_a_conversation_and_rebuilding_its_ledger_leave_the_event_loop_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each waits for a task on the event loop: were either on the loop, it would wait for
    itself (and fail after the timeout)."""
    import threading

    from pipeline.replacement import ReplacementState

    history = [user("go"), call("t1"), answer("t1", "x" * 5_000)]
    anyio.run(send, registry(tmp_path), history)  # a conversation on disk
    steps = ("load", "rebuild")
    began = {step: threading.Event() for step in steps}
    freed = {step: threading.Event() for step in steps}
    load, rebuild = Conversations._load_family, ReplacementState.reconstruct.__func__

    def held(step: str) -> None:
        began[step].set()
        assert freed[step].wait(5), f"{step} held the event loop"

    def slow_load(self: Conversations, *args: Any) -> Any:
        held("load")
        return load(self, *args)

    def slow_rebuild(cls: type[ReplacementState], *args: Any, **kwargs: Any) -> Any:
        held("rebuild")
        return rebuild(cls, *args, **kwargs)

    monkeypatch.setattr(Conversations, "_load_family", slow_load)
    monkeypatch.setattr(ReplacementState, "reconstruct", classmethod(slow_rebuild))

    async def main() -> None:
        async def free() -> None:  # runs only while the event loop is free
            for step in steps:
                while not began[step].is_set():
                    await anyio.sleep(0.01)
                freed[step].set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(free)
            _, again = await send(registry(tmp_path), [*history, call("t2"), answer("t2", "y")])
        assert again[2]["content"][0]["content"].startswith(TAG)

    anyio.run(main)


def test_whoever_keeps_something_of_a_conversation_is_told_when_it_is_let_go(
    tmp_path: Path,
) -> None:
    let_go: list[str] = []
    conversations = Conversations(
        pipeline=lambda: Pipeline([ToolResultBudget()]),
        root=tmp_path,
        logger=QuietLogger(),
        max_held=1,
        on_let_go=lambda branch: let_go.append(branch.conversation_id),
    )

    async def route(opening: str) -> Branch:
        body = {"model": "m", "messages": [{"role": "user", "content": opening}]}
        return await conversations.route(body, {"x-api-key": "k"})

    async def run() -> list[str]:
        first = await route("the first conversation")
        assert let_go == []
        await route("another one")  # past max_held: the first family goes
        return [first.conversation_id]

    assert anyio.run(run) == let_go


def test_a_conversation_let_go_with_a_response_held_back_loads_again_with_it(
    tmp_path: Path,
) -> None:
    """A response observed with ``defer`` (its record held back until its client has it) of a
    conversation let go meanwhile is written then: a request that loads the conversation
    again knows that response, as one whose record was written at once would."""

    async def run() -> bool:
        conversations = Conversations(
            pipeline=lambda: Pipeline([ToolResultBudget()]),
            root=tmp_path,
            storage=SessionStates(tmp_path, fsync_each=False),  # appends held back: the proxy's
            max_held=1,
        )
        first = [{"role": "user", "content": "conversation A " * 30}]
        held = (await conversations.route({"messages": first}, {}, unchanging=True)).session
        _, call = await held.prepare_call({"model": "m", "messages": first})
        usage = {"input_tokens": 100, "output_tokens": 5}
        await held.observe_async("msg_A1", usage, "m", call=call, defer=True)
        other = [{"role": "user", "content": "another " * 30}]
        await conversations.route({"messages": other}, {})  # A is let go
        then = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        again = (await conversations.route({"messages": then}, {}, unchanging=True)).session
        assert again is not held  # loaded from its records
        await again.prepare_call({"model": "m", "messages": then})
        return any(seen[0] == "msg_A1" for seen in again._responses.values())

    assert anyio.run(run)


def test_the_openings_remembered_are_no_more_than_the_conversations_held(tmp_path: Path) -> None:
    """The memo of openings holds its requests' system prompts and first messages (up to a
    body's size each): never for more requests than conversations are held."""

    async def run() -> int:
        conversations = Conversations(
            pipeline=lambda: Pipeline([ToolResultBudget()]), root=tmp_path, max_held=2
        )
        for k in range(6):
            body = {"system": f"prompt {k} " * 100, "messages": [{"role": "user", "content": k}]}
            await conversations.route(body, {}, unchanging=True)
        return len(conversations._openings._kept)

    assert anyio.run(run) <= 2


def test_a_conversation_whose_answer_is_still_to_be_read_is_not_let_go(tmp_path: Path) -> None:
    """The proxy reads a JSON answer once its client has it: until then the conversation is
    not let go from memory (its client's next request must find the session that reads it),
    and that request's pass waits for the answer and knows it; once read, it may go."""

    async def run() -> tuple[bool, bool, int]:
        conversations = Conversations(
            pipeline=lambda: Pipeline([ToolResultBudget()]),
            root=tmp_path,
            storage=SessionStates(tmp_path, fsync_each=False),
            max_held=1,
        )
        first = [{"role": "user", "content": "conversation A " * 30}]
        held = (await conversations.route({"messages": first}, {}, unchanging=True)).session
        _, call = await held.prepare_call({"model": "m", "messages": first})
        token = held.answer_out()  # its bytes went to the client, not yet read
        other = [{"role": "user", "content": "another " * 30}]
        await conversations.route({"messages": other}, {})  # would let A go
        then = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        again = (await conversations.route({"messages": then}, {}, unchanging=True)).session
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(again.prepare_call, {"model": "m", "messages": then})
            await anyio.sleep(0.05)
            usage = {"input_tokens": 100, "output_tokens": 5}
            await held.observe_async("msg_A1", usage, "m", call=call, defer=True)
            held.answer_read(token)
        known = any(seen[0] == "msg_A1" for seen in again._responses.values())
        await conversations.route({"messages": other}, {})  # now A may go
        return again is held, known, conversations.held

    same, known, left = anyio.run(run)
    assert same and known
    assert left == 1


def test_a_branch_holds_its_family_weakly_unless_no_index_holds_it(tmp_path: Path) -> None:
    """A branch's family is held by the index, not by the branch (the family holds the branch:
    a let-go conversation must not wait in a cycle for the collector); an unsure family (its
    records could not be read), which no index holds, is held by its branch for its request."""
    import gc

    from pipeline.dropin.families import Family

    states = SessionStates(tmp_path, fsync_each=False)
    branches = []
    for unsure in (False, True):
        family = Family("t", "f", b"o", states, tmp_path, unsure=unsure)
        branch = Branch(family, None, session=None)  # type: ignore[arg-type]
        family.branches[None] = branch
        assert (branch.tenant, branch.conversation_id) == ("t", "f")
        branches.append(branch)
        del family
    held, unsure_one = branches
    gc.collect()
    with pytest.raises(LookupError, match="conversation f: its family was let go"):
        held.family  # noqa: B018 - the property is what is tested
    assert unsure_one.family.unsure
    assert held.key == ("t", "f")  # its name and tenant outlive the family


def test_a_family_with_a_held_call_is_not_let_go(tmp_path: Path) -> None:
    """``wrap`` takes no call lock: a conversation routed with ``hold`` keeps its family held
    until :meth:`Conversations.done`, so its pass still finds how the family's other
    conversations sent a result."""
    import types

    def turns(*texts: str) -> dict[str, Any]:  # the user's turns, answered "ok" between
        ok = {"role": "assistant", "content": "ok"}
        return body([m for t in texts for m in (ok, user(t))][1:])

    conversations = Conversations(
        pipeline=lambda: Pipeline([]), root=tmp_path, max_held=2, tenancy=Tenancy(single=True)
    )
    decided = types.SimpleNamespace(key="k", replacement="R")

    async def main() -> None:
        first = await conversations.route(turns("x", "p"), {}, hold=True)
        sibling = await conversations.route(turns("x", "q"), {})
        assert sibling.family is first.family
        sibling.session.decisions_on = lambda keys: ([decided], set())  # type: ignore[method-assign]
        await conversations.route(turns("another"), {})  # past max_held: one family must go
        assert first.session.elsewhere is not None
        assert first.session.elsewhere({"k"}) == ([decided], set())
        conversations.done(first)
        await conversations.route(turns("a third"), {})  # now it may go
        assert conversations.held <= 2

    anyio.run(main)


def test_a_conversation_alone_in_its_family_asks_no_other(tmp_path: Path) -> None:
    """A family's first conversation has no other to ask how a result was sent: its first
    call makes no worker-thread call for it. A second conversation of the family makes the
    first one's next request ask again, and a family let go leaves nothing to ask."""
    import gc

    def turns(*texts: str) -> dict[str, Any]:
        ok = {"role": "assistant", "content": "ok"}
        return body([m for t in texts for m in (ok, user(t))][1:])

    conversations = Conversations(
        pipeline=lambda: Pipeline([]), root=tmp_path, max_held=2, tenancy=Tenancy(single=True)
    )
    asked: list[set[str]] = []

    async def main() -> None:
        first = await conversations.route(turns("x", "p"), {})
        elsewhere = first.session.elsewhere
        assert elsewhere is not None and elsewhere.alone()
        sibling = await conversations.route(turns("x", "q"), {})
        assert sibling.family is first.family
        assert not elsewhere.alone() and not sibling.session.elsewhere.alone()  # type: ignore[union-attr]
        sibling.session.decisions_on = (  # type: ignore[method-assign]
            lambda keys: (asked.append(set(keys)), ([], set()))[1]
        )
        assert elsewhere({"k"}) == ([], set()) and asked == [{"k"}]
        await conversations.route(turns("another"), {})  # past max_held: the family goes
        del first, sibling
        gc.collect()
        assert elsewhere.alone()

    anyio.run(main)


def test_a_sibling_routed_to_meanwhile_is_never_missed(tmp_path: Path) -> None:
    """``alone()`` reads the family without the index's lock: a conversation routed to on
    another thread (the synchronous ``wrap``'s callers) moves to the front of the family's
    list, and a reader at that moment still sees it."""
    import sys
    import threading

    from pipeline.dropin.branching import FamilyDecisions
    from pipeline.dropin.families import Family

    lock = threading.Lock()
    family = Family("t", "f", b"o", SessionStates(tmp_path, fsync_each=False), tmp_path)
    mine = Branch(family, None, session=None)  # type: ignore[arg-type]
    sibling = Branch(family, "s", session=None)  # type: ignore[arg-type]
    family.branches = {None: mine, "s": sibling}
    for branch in (mine, sibling):
        family.register(branch, [branch.name.encode() if branch.name else b"m"])
    decisions = FamilyDecisions(lock, family, None)
    stop = threading.Event()

    def route() -> None:
        while not stop.is_set():
            for branch in (mine, sibling):
                with lock:
                    family.register(branch, list(branch.chain))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    router = threading.Thread(target=route)
    router.start()
    try:
        missed = sum(decisions.alone() for _ in range(20_000))
    finally:
        stop.set()
        router.join()
        sys.setswitchinterval(interval)
    assert missed == 0


def test_an_unsure_family_lasts_its_request(tmp_path: Path) -> None:
    """A family whose records a shared store could not give is held by no index, only by its
    branch: it must last the request (a reload once the store answers again reads it)."""
    import gc

    class Shared(SessionStates):
        @property
        def shared(self) -> bool:
            return True

    conversations = Conversations(
        pipeline=lambda: Pipeline([]),
        root=tmp_path,
        storage=Shared(tmp_path, fsync_each=False),
        tenancy=Tenancy(single=True),
    )

    def down(*_args: Any) -> Any:
        raise OSError("the store does not answer")

    conversations._load_family = down  # type: ignore[method-assign]
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}

    async def main() -> None:
        branch = await conversations.route(body, {})
        await anyio.to_thread.run_sync(lambda: None)
        gc.collect()
        assert branch.family.unsure
        await conversations.reload(branch)

    anyio.run(main)


def _long_history(rounds: int) -> list[dict[str, Any]]:
    return [user("go")] + [m for k in range(rounds) for m in (call(f"t{k}"), answer(f"t{k}", "x"))]


def test_a_long_request_new_to_its_family_is_digested_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digests wait for a task of the event loop: were they taken on the loop, they would
    wait for themselves (and fail after the timeout). The calls that follow, the last
    message's cache mark moved as Claude Code moves it, are digested on the loop."""
    from pipeline.dropin import conversations as module

    witness = OffTheLoop()
    digest = module.chain_of

    def waiting(*args: Any, **kwargs: Any) -> Any:
        witness.wait("digested")
        return digest(*args, **kwargs)

    monkeypatch.setattr(module, "chain_of", waiting)
    history = _long_history(module.OFF_LOOP_MESSAGES // 2)

    async def main() -> None:
        conversations = registry(tmp_path)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(witness.free)
            first, _ = await send(conversations, history)
        assert conversations.off_loop == 1
        marked = [*history, call("u1"), user("next", cache_control={"type": "ephemeral"})]
        second, _ = await send(conversations, marked)
        third, _ = await send(conversations, [*marked[:-1], user("next"), call("u2")])
        assert first is second is third and conversations.off_loop == 1

    anyio.run(main)


def test_requests_digested_off_the_loop_are_placed_as_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Growing, forking, a retry of an earlier request and a new process, each request
    digested whole off the loop: the same conversations, the same bytes sent."""
    from pipeline.dropin import conversations as module

    history = _long_history(3)

    async def run(root: Path) -> list[tuple[str | None, str]]:
        def seen(branch: Branch, out: list[Any]) -> tuple[str | None, str]:
            # each store digests its tenants under a key of its own
            text = json.dumps(out).replace(str(root), "ROOT")
            return branch.name, re.sub(r"/t-[0-9a-f]+/", "/t-/", text)

        conversations = registry(root)
        sent = []
        for messages in (
            history,
            [*history, call("t9"), answer("t9", "y" * 5_000)],
            [*history, call("f1"), answer("f1", "z" * 5_000)],  # a fork
            history,  # a retry of the first
        ):
            sent.append(seen(*await send(conversations, messages)))
        grown = [*history, call("t9"), answer("t9", "y" * 5_000)]
        return [*sent, seen(*await send(registry(root), grown))]  # a new process

    inline = anyio.run(run, tmp_path / "inline")
    monkeypatch.setattr(module, "OFF_LOOP_MESSAGES", 0)
    assert anyio.run(run, tmp_path / "off") == inline


def test_a_conversation_let_go_while_its_request_is_digested_is_placed_where_it_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a request is digested off the loop, another conversation's request lets its
    family go (one held at most): the request is placed in the family loaded again, the one
    held, so its retry meets the very conversation whose call is in flight."""
    import copy
    import threading

    from pipeline.dropin import conversations as module

    other_routed = threading.Event()
    digest = module.chain_of

    def waiting(*args: Any, **kwargs: Any) -> Any:
        assert other_routed.wait(5), "the other request was never routed"
        return digest(*args, **kwargs)

    history = [user("A go"), call("t1"), answer("t1", "x")]
    grown = [*copy.deepcopy(history), call("t2"), answer("t2", "y")]

    async def main() -> None:
        conversations = registry(tmp_path, max_held=1)
        await send(conversations, history)
        monkeypatch.setattr(module, "chain_of", waiting)
        monkeypatch.setattr(module, "OFF_LOOP_MESSAGES", 3)
        placed: dict[str, Branch] = {}

        async def grows() -> None:
            placed["a"] = await conversations.route(body(grown), KEY_A)
            async with placed["a"].call_lock:  # its call in flight, as the proxy holds it
                placed["retry"] = await conversations.route(body(copy.deepcopy(grown)), KEY_A)

        async def other() -> None:
            await conversations.route(body([user("B go")]), KEY_A)
            other_routed.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(grows)
            await anyio.sleep(0.05)
            tasks.start_soon(other)
        assert conversations.off_loop == 2
        assert placed["retry"] is placed["a"]
        assert placed["a"].keep is None  # held by the index, not only by its branch

    anyio.run(main)


def test_a_request_equal_to_its_conversations_last_but_not_the_same_objects_is_digested_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SDK client (``wrap``) builds its messages anew each call: a long conversation's next
    call, equal to its last but for what it adds, is not digested whole again."""
    import copy

    from pipeline.dropin import conversations as module

    history = _long_history(module.OFF_LOOP_MESSAGES // 2)

    async def main() -> None:
        conversations = registry(tmp_path)
        await send(conversations, history)
        assert conversations.off_loop == 1
        await send(conversations, [*copy.deepcopy(history), call("u1"), answer("u1", "z")])
        assert conversations.off_loop == 1

    anyio.run(main)


def test_what_a_replaced_session_writes_after_a_reload_is_news(tmp_path: Path) -> None:
    """A conversation loaded again (another writer moved it on) gets a writer of its own on a
    local store: what the session it replaced still writes (a response recorded late) is
    news to it, not its own."""

    async def main() -> None:
        conversations = registry(tmp_path)
        branch, _ = await send(conversations, [user("task"), call("t1"), answer("t1", "x")])
        old = branch.session
        await conversations.reload(branch)
        assert branch.session is not old and await conversations.current(branch)
        old.storage.records.append_stage_record("late", {"k": 1})
        assert not await conversations.current(branch)  # news: loaded again

    anyio.run(main)
