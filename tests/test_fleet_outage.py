"""A fleet through a store outage: workers that cannot read the store (one a call behind, one
new to the conversation) send what a fleet without an outage sends, so the model never sees a
result change form; what they persist meanwhile waits in their spool and reaches the store when
it is back.

Proxies served in this process (uvicorn threads) on one in-memory object store that a switch
takes down and brings back (every call raising ``OSError`` meanwhile), the real SDK as the
client. The reference is the same conversation through one proxy alone, on a store with the
same tenancy secret (so the URIs the model is shown are the same).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from pipeline import Pipeline
from pipeline.dropin.conversations import SESSION_HEADER
from pipeline.store.sessions import SECRET_NAME, SessionStates
from pipeline.store.spool import Spool
from pipeline.testing import QuietLogger, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.objectstore_support import Outage, Wrapped, keys_of
from tests.test_fleet import PER_MESSAGE, PREFIX, TAG, Conversation, results_of, script
from tests.wire_support import proxy

pytest.importorskip("uvicorn", reason="the proxy extra is not installed")
obstore = pytest.importorskip("obstore", reason="the objectstore extra is not installed")


def budget() -> Pipeline:
    return Pipeline([ToolResultBudget(limit=int(PER_MESSAGE))])


@contextlib.contextmanager
def worker(
    upstream: str, root: Path, memory: Any, switch: Outage, *, spool: bool = True
) -> Iterator[str]:
    """A proxy on ``memory`` behind ``switch`` (no circuit breaker: each call asks the store,
    so the test needs no waiting), its spool under ``root``."""
    states = SessionStates(
        "memory:///" + PREFIX,
        object_store=Wrapped(memory, before=switch.hooks()),
        cool_down=None,
        spool=root / "spool" if spool else None,
    )
    with proxy(upstream, root, budget, storage=states, logger=QuietLogger()) as url:
        yield url


def warm_up(url: str) -> None:
    """Another conversation through ``url``: the worker has met the store (its tenancy secret)
    before it serves the conversation under test."""
    client = anthropic.Anthropic(
        base_url=url, api_key="k", max_retries=0, default_headers={SESSION_HEADER: "warm-up"}
    )
    client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def reference(tmp_path: Path, calls: int) -> tuple[list[dict[str, Any]], bytes]:
    """The conversation through one proxy alone, and its store's tenancy secret."""
    memory = obstore.store.MemoryStore()
    with ScriptedMessagesServer(script) as upstream:
        with worker(upstream.base_url, tmp_path / "alone", memory, Outage(down=False)) as url:
            conversation = Conversation()
            for _ in range(calls):
                conversation.call(url)
        requests = list(upstream.requests)
    secret = bytes(memory.get(f"{PREFIX}/{SECRET_NAME}").bytes())
    return requests, secret


def test_workers_that_cannot_read_the_store_send_what_a_fleet_without_an_outage_sends(
    tmp_path: Path,
) -> None:
    """Calls 0-2 through A; the store goes down; call 3 through B (new to the conversation:
    it cannot load it), 4 through A (a call behind: it cannot learn of 3), 5 through B again;
    the store comes back; 6 through A, 7 through C (a worker new to everything, reading
    records that miss calls 3-5), 8 through B. Every request is the reference's, byte for
    byte; each worker's spool is empty at the end and the store holds each persisted result
    once."""
    calls, down = 9, range(3, 6)
    expected, secret = reference(tmp_path, calls)
    route = ["a", "a", "a", "b", "a", "b", "a", "c", "b"]
    memory = obstore.store.MemoryStore()
    memory.put(f"{PREFIX}/{SECRET_NAME}", secret)
    switch = Outage(down=False)
    with ScriptedMessagesServer(script) as upstream, contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(worker(upstream.base_url, tmp_path / name, memory, switch))
            for name in "abc"
        }
        warm_up(urls["b"])
        conversation = Conversation()
        for k, name in enumerate(route):
            switch.down = k in down
            conversation.call(urls[name])
        requests = [r for r in upstream.requests if r["messages"][0]["content"] != "hi"]

    assert len(requests) == calls
    for k in range(calls):
        assert json.dumps(requests[k]) == json.dumps(expected[k]), (k, route[k])
    # the outage's calls did persist (to the spools), and the spools reached the store
    persisted = {k for k, v in results_of(requests[-1]).items() if v.startswith(TAG)}
    assert {"toolu_02_1", "toolu_02_2", "toolu_04_1", "toolu_04_2"} <= persisted
    for name in "ab":
        assert len(Spool(tmp_path / name / "spool")) == 0, name
    stored = [k for k in keys_of(memory, PREFIX) if "/tool-results/" in k]
    assert len(stored) == len(persisted) == len({k.rsplit("/", 1)[1] for k in stored})


def test_without_a_spool_a_result_persisted_in_the_outage_is_sent_whole(tmp_path: Path) -> None:
    """The limit a spool removes: a worker without one sends whole what it could not persist
    (and so does every worker after it, from the record of that)."""
    memory = obstore.store.MemoryStore()
    switch = Outage(down=False)
    with ScriptedMessagesServer(script) as upstream:
        with worker(upstream.base_url, tmp_path / "a", memory, switch, spool=False) as url:
            conversation = Conversation()
            for k in range(3):
                switch.down = k == 1  # the call that carries turn 0's results
                conversation.call(url)
        requests = upstream.requests
    after = results_of(requests[2])
    assert not after["toolu_00_2"].startswith(TAG)  # sent whole: it could not be persisted
    assert after["toolu_01_2"].startswith(TAG)  # the store is back


def test_without_a_spool_what_went_whole_in_the_outage_stays_whole_on_another_worker(
    tmp_path: Path,
) -> None:
    """Without a spool a persist that fails sends the result whole, and its record may fail
    too: a worker that re-decided it would send a replacement. So only a fleet with spools
    re-decides; without, the next worker counts the result as sent, and the prefix holds."""
    memory = obstore.store.MemoryStore()
    switch = Outage(down=False)
    with ScriptedMessagesServer(script) as upstream, contextlib.ExitStack() as stack:
        a, b = (
            stack.enter_context(
                worker(upstream.base_url, tmp_path / n, memory, switch, spool=False)
            )
            for n in "ab"
        )
        conversation = Conversation()
        for k, url in enumerate([a, a, b, b]):
            switch.down = k == 1  # turn 0's results: neither persisted nor recorded
            conversation.call(url)
        requests = upstream.requests
    for k in range(1, len(requests)):
        previous = requests[k - 1]["messages"]
        assert requests[k]["messages"][: len(previous)] == previous, k
    assert not results_of(requests[-1])["toolu_00_2"].startswith(TAG)
