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
from pipeline.dropin.wrap import wrap
from pipeline.store.sessions import SECRET_NAME, SessionStates
from pipeline.store.spool import Spool
from pipeline.testing import QuietLogger, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.objectstore_support import Outage, Wrapped, keys_of
from tests.test_fleet import PER_MESSAGE, PREFIX, SID, TAG, Conversation, results_of, script
from tests.wire_support import proxy

pytest.importorskip("uvicorn", reason="the proxy extra is not installed")
obstore = pytest.importorskip("obstore", reason="the objectstore extra is not installed")


class RecordsLag:
    """A fault hook: while ``on``, a record object that lists cannot be read yet (a store whose
    reads lag its listings), as a ``FileNotFoundError``."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, path: str, **_kwargs: Any) -> None:
        if self.on and "/records/" in path:
            raise FileNotFoundError(path)

    def hooks(self) -> dict[str, Any]:
        """``before`` for :class:`Wrapped`: before each ``get``."""
        return {"get": self}


def budget() -> Pipeline:
    return Pipeline([ToolResultBudget(limit=int(PER_MESSAGE))])


@contextlib.contextmanager
def worker(
    upstream: str,
    root: Path,
    memory: Any,
    switch: Outage | RecordsLag,
    *,
    spool: bool = True,
    store: Wrapped | None = None,
) -> Iterator[str]:
    """A proxy on ``memory`` behind ``switch`` (no circuit breaker: each call asks the store,
    so the test needs no waiting), its spool under ``root``; ``store``: the wrapper to use."""
    states = SessionStates(
        "memory:///" + PREFIX,
        object_store=store or Wrapped(memory, before=switch.hooks()),
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


def test_a_worker_whose_reads_lag_for_a_call_is_placed_as_it_served_it(tmp_path: Path) -> None:
    """B, a call behind at call 5, finds news it cannot read (records that list but answer not
    found, every try): the call goes as placed. Its next call (8, the store well again) is
    that conversation's, not a new one's: B loads what A and C recorded meanwhile and sends
    what they sent -- a result they sent as a preview is never sent whole."""
    calls = 9
    expected, secret = reference(tmp_path, calls)
    route = ["a", "a", "a", "b", "a", "b", "c", "a", "b"]
    memory = obstore.store.MemoryStore()
    memory.put(f"{PREFIX}/{SECRET_NAME}", secret)
    well, lag = Outage(down=False), RecordsLag()
    with ScriptedMessagesServer(script) as upstream, contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                worker(upstream.base_url, tmp_path / name, memory, lag if name == "b" else well)
            )
            for name in "abc"
        }
        warm_up(urls["b"])
        conversation = Conversation()
        for k, name in enumerate(route):
            lag.on = k == 5
            conversation.call(urls[name])
        requests = [r for r in upstream.requests if r["messages"][0]["content"] != "hi"]
    assert len(requests) == calls
    for k in range(calls):
        assert json.dumps(requests[k]) == json.dumps(expected[k]), (k, route[k])
    branches = {k.split("/")[3] for k in keys_of(memory, PREFIX) if "/records" in k}
    assert branches == {"records", "records-snapshots"}, branches


def test_a_worker_whose_listings_lag_sends_what_the_fleet_sent(tmp_path: Path) -> None:
    """C joins at call 6 and its listings find nothing six times in a row (a store whose
    listings lag its writes), though the records' numbers say there are some: the call goes
    as placed, deciding what no record tells it of again -- as A and B decided it -- rather
    than taking the conversation for one new to the store and every earlier result for sent
    whole (at its next call, once its listings are well again)."""
    calls = 10
    expected, secret = reference(tmp_path, calls)
    route = ["a", "a", "a", "b", "a", "b", "c", "a", "b", "c"]
    memory = obstore.store.MemoryStore()
    memory.put(f"{PREFIX}/{SECRET_NAME}", secret)
    well = Outage(down=False)
    lagging = Wrapped(memory, before=well.hooks())
    with ScriptedMessagesServer(script) as upstream, contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                worker(
                    upstream.base_url,
                    tmp_path / name,
                    memory,
                    well,
                    store=lagging if name == "c" else None,
                )
            )
            for name in "abc"
        }
        warm_up(urls["c"])
        conversation = Conversation()
        for k, name in enumerate(route):
            if k == 6:
                lagging.stale_lists = 6
            conversation.call(urls[name])
        requests = [r for r in upstream.requests if r["messages"][0]["content"] != "hi"]
    assert len(requests) == calls
    for k in range(calls):
        assert json.dumps(requests[k]) == json.dumps(expected[k]), (k, route[k])


class WrappedClients(Conversation):
    """The conversation sent by wrapped clients, one per name, each on its own view of one
    store (a program per host of a fleet), rather than through proxies."""

    def __init__(self, upstream: str, tmp_path: Path, stores: dict[str, Wrapped]) -> None:
        super().__init__()
        self.upstream, self.tmp_path, self.stores = upstream, tmp_path, stores

    def client(self, url: str) -> anthropic.Anthropic:
        found = self._clients.get(url)
        if found is None:
            states = SessionStates(
                "memory:///" + PREFIX,
                object_store=self.stores[url],
                cool_down=None,
                spool=self.tmp_path / url / "spool",
            )
            raw = anthropic.Anthropic(
                base_url=self.upstream,
                api_key="k",
                max_retries=0,
                default_headers={SESSION_HEADER: SID},
            )
            found = wrap(raw, root=self.tmp_path / url, pipeline=budget, storage=states)
            self._clients[url] = found
        return found


def test_wrapped_clients_whose_listings_lag_send_what_one_client_sends(tmp_path: Path) -> None:
    """``wrap`` as the proxy: B's listings find nothing six times in a row when it joins (call
    3), though the records' numbers say there are some; it decides again what no record
    tells it of, and every request is what one client alone sends."""
    route = ["a", "a", "a", "b", "a", "b"]
    memory = obstore.store.MemoryStore()
    with ScriptedMessagesServer(script) as upstream:
        alone = WrappedClients(upstream.base_url, tmp_path / "alone", {"a": Wrapped(memory)})
        for _ in route:
            alone.call("a")
        expected = list(upstream.requests)
    secret = bytes(memory.get(f"{PREFIX}/{SECRET_NAME}").bytes())
    memory = obstore.store.MemoryStore()
    memory.put(f"{PREFIX}/{SECRET_NAME}", secret)
    stores = {"a": Wrapped(memory), "b": Wrapped(memory)}
    with ScriptedMessagesServer(script) as upstream:
        fleet = WrappedClients(upstream.base_url, tmp_path / "fleet", stores)
        for k, name in enumerate(route):
            if k == 3:
                stores["b"].stale_lists = 6
            fleet.call(name)
        requests = list(upstream.requests)
    assert len(requests) == len(route)
    for k in range(len(route)):
        assert json.dumps(requests[k]) == json.dumps(expected[k]), (k, route[k])


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
