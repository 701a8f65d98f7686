"""A fleet of proxies on one object store: real ``python -m pipeline proxy`` processes sharing
``--store s3://BUCKET/fleet`` on moto's S3 server, and ``--store az://CONTAINER/fleet`` on
Azurite's Azure Blob server (both on 127.0.0.1), in front of one scripted Messages API, with
the real SDK as the client. One conversation moves between workers every few calls,
two workers take the same request at once, the store goes away and comes back, every worker is
killed and replaced -- and what reaches the upstream is compared, byte for byte, with the same
conversation through one proxy that never moved (the same prefix and session in another
bucket: only the bucket's name differs in the URIs the model is shown).

Skipped where a server cannot start (no ``moto[server]``; no Node for Azurite, which the tests
install once with npm into ``~/.cache/sluicegate-tests``; no local socket).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from pipeline import Pipeline
from pipeline.dropin.conversations import SESSION_HEADER
from pipeline.store.sessions import SessionStates
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.cli_support import clean_env, run_cli
from tests.objectstore_support import (
    SECRET_KEY,
    Azurite,
    MotoS3,
    Wrapped,
    keys_of,
    start_azurite,
    start_moto,
)
from tests.wire_support import proxy

pytest.importorskip("uvicorn", reason="the proxy extra is not installed")

SID = "fleet-conv-1"
PREFIX = "fleet"
CALLS = 50
TAG = "<persisted-output>"
SIZES = (300, 2_600, 3_000)
"""Characters of the three parallel results of a turn: over the 2,500-char budget the
proxies are given, so the budget persists the two largest (every fourth turn has one small
result and nothing to persist)."""
PER_MESSAGE = "2500"
COOL_DOWN = 1.0
"""Seconds a worker leaves a store that failed alone (short: the outage tests wait it out)."""
_BANNER = re.compile(r"sluicegate proxy on (http://127\.0\.0\.1:\d+) ")


# ---------------------------------------------------------------------------------------------
# the conversation
# ---------------------------------------------------------------------------------------------


def script(body: dict[str, Any]) -> Reply:
    """The model's side: three parallel log reads per turn, one every fourth turn."""
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    count = 1 if turn % 4 == 3 else len(SIZES)
    return Reply(
        [
            {"type": "tool_use", "id": f"toolu_{turn:02d}_{i}", "name": "get_log", "input": {}}
            for i in range(count)
        ],
        stop_reason="tool_use",
    )


def output(tool_use_id: str, size: int) -> str:
    """A log of ``size`` characters, its lines naming the call."""
    line = f"{tool_use_id} job log line\n"
    return (line * (size // len(line) + 1))[:size]


def answer(content: list[Any]) -> dict[str, Any]:
    """The user message answering every tool_use of a response."""
    uses = [b for b in content if b.type == "tool_use"]
    sizes = SIZES if len(uses) > 1 else (SIZES[0],)
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": output(b.id, n)}
            for b, n in zip(uses, sizes, strict=True)
        ],
    }


class Conversation:
    """The client: the real SDK re-sending its whole history, the conversation named by the
    session header; each call goes to the proxy a test names. Every call must succeed (the
    SDK raises on any error status: no retries)."""

    def __init__(self, prompt: str = "read the job logs") -> None:
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        self.calls = 0
        self._clients: dict[str, anthropic.Anthropic] = {}

    def client(self, url: str) -> anthropic.Anthropic:
        found = self._clients.get(url)
        if found is None:
            found = anthropic.Anthropic(
                base_url=url,
                api_key="k",
                max_retries=0,
                timeout=60,
                default_headers={SESSION_HEADER: SID},
            )
            self._clients[url] = found
        return found

    def call(self, url: str) -> anthropic.types.Message:
        """One call through ``url``, its response returned; every fourth is streamed (the
        usage read from events)."""
        client = self.client(url)
        if self.calls % 4 == 1:
            with client.messages.stream(
                model="m",
                max_tokens=10,
                messages=self.messages,  # type: ignore[arg-type]
            ) as stream:
                response = stream.get_final_message()
        else:
            response = client.messages.create(
                model="m",
                max_tokens=10,
                messages=self.messages,  # type: ignore[arg-type]
            )
        self.calls += 1
        blocks = [b.model_dump(exclude_none=True) for b in response.content]
        self.messages.append({"role": "assistant", "content": blocks})
        self.messages.append(answer(response.content))
        return response


def conversation_key(store: Any) -> str:
    """The key prefix of the one conversation on the store: ``<PREFIX>/<tenant>/<name>``."""
    found = {"/".join(k.split("/")[:3]) for k in keys_of(store, PREFIX) if k.count("/") >= 3}
    assert len(found) == 1, found
    return found.pop()


def same_tenant(texts: list[str]) -> list[str]:
    """``texts`` with the tenant's name written alike: it is a digest under each store's own
    secret, so two buckets name one client's tenant differently."""
    return [re.sub(r"t-[0-9a-f]{20}", "TENANT", t) for t in texts]


def sent(upstream: ScriptedMessagesServer) -> list[str]:
    """What the upstream received, one JSON text per request, in order."""
    return [json.dumps(body) for body in upstream.requests]


def results_of(body: dict[str, Any]) -> dict[str, str]:
    """Every tool result of a request by id, as the model sees it."""
    found: dict[str, str] = {}
    for message in body["messages"]:
        if isinstance(message["content"], list):
            for block in message["content"]:
                if block.get("type") == "tool_result":
                    found[block["tool_use_id"]] = block["content"]
    return found


# ---------------------------------------------------------------------------------------------
# the workers: real proxy processes
# ---------------------------------------------------------------------------------------------


@dataclass
class Worker:
    """One ``python -m pipeline proxy`` process; its stderr is collected as it comes."""

    process: subprocess.Popen[str]
    url: str = ""
    lines: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            found = _BANNER.match(line)
            if found:
                self.url = found.group(1)
                self.started.set()
        self.started.set()  # gone without a banner: the waiter sees no URL

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        """A graceful stop (SIGINT), as an operator would."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=30)

    def kill(self) -> None:
        """SIGKILL: nothing is flushed, closed or said."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


Server = MotoS3 | Azurite
"""A fleet's object store: S3 (moto) or Azure Blob Storage (Azurite)."""


@pytest.fixture(scope="module", params=["s3", "azure"])
def fleet_store(request: pytest.FixtureRequest) -> Server:
    """Each object store the fleet tests run on."""
    server: Server = request.getfixturevalue("moto_s3" if request.param == "s3" else "azurite")
    return server


def start_server(kind: str, home: Path) -> Server:
    """A server of ``kind`` of the test's own (one it stops and starts again), its data (if
    not in memory) under ``home``."""
    return start_moto() if kind == "s3" else start_azurite(home / "azurite")


def worker_env(server: Server) -> dict[str, str]:
    """The environment of a worker: the caller's without any object-store settings, plus
    the server's."""
    env = {k: v for k, v in clean_env().items() if not k.startswith(("AWS_", "AZURE_", "AZURITE_"))}
    env.update(server.env())
    return env


def start_workers(
    count: int, upstream: str, store: str, env: dict[str, str], home: Path
) -> list[Worker]:
    """``count`` proxies on ports the system picks, each in a directory of its own (a host:
    its token calibration stays there), started together; returned once each serves."""
    workers = []
    for _ in range(count):
        where = home / f"host-{len(list(home.glob('host-*')))}"
        where.mkdir(parents=True)
        process = subprocess.Popen(
            [
                sys.executable, "-m", "pipeline", "proxy", "--port", "0",
                "--upstream", upstream, "--store", store,
                "--per-message-chars", PER_MESSAGE, "--store-retries", "1",
                "--store-cool-down", str(COOL_DOWN),
            ],
            cwd=where,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        worker = Worker(process)
        threading.Thread(target=worker.read, daemon=True).start()
        workers.append(worker)
    for worker in workers:
        assert worker.started.wait(timeout=60), "a proxy did not start"
        assert worker.url, f"a proxy exited: {worker.stderr[-2000:]}"
        _wait_healthy(worker.url)
    return workers


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
                if response.read() == b"ok":
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"{url} never answered /healthz"
        time.sleep(0.05)


@pytest.fixture
def workers() -> Iterator[Callable[..., list[Worker]]]:
    """Start workers; every one still running is stopped after the test."""
    started: list[Worker] = []

    def start(*args: Any) -> list[Worker]:
        made = start_workers(*args)
        started.extend(made)
        return made

    yield start
    for worker in started:
        worker.kill()


def run_alone(server: Server, home: Path, calls: int) -> tuple[str, list[str]]:
    """The conversation through one proxy that never moves: its bucket and what was sent."""
    bucket = server.new_bucket()
    with ScriptedMessagesServer(script) as upstream:
        (only,) = start_workers(
            1, upstream.base_url, server.url(bucket, PREFIX), worker_env(server), home
        )
        try:
            conversation = Conversation()
            for _ in range(calls):
                conversation.call(only.url)
        finally:
            only.stop()
        return bucket, sent(upstream)


@pytest.fixture(scope="module")
def alone(fleet_store: Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """The reference run: :data:`CALLS` calls through one proxy, computed once per store."""
    return run_alone(fleet_store, tmp_path_factory.mktemp("alone"), CALLS)


# ---------------------------------------------------------------------------------------------
# (a) a conversation that moves between workers
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_conversation_moving_between_workers_sends_what_one_worker_sends(
    fleet_store: Server,
    alone: tuple[str, list[str]],
    workers: Callable[..., list[Worker]],
    tmp_path: Path,
) -> None:
    reference_bucket, reference = alone
    bucket = fleet_store.new_bucket()
    with ScriptedMessagesServer(script) as upstream:
        pair = workers(
            2, upstream.base_url, fleet_store.url(bucket, PREFIX), worker_env(fleet_store), tmp_path
        )
        conversation = Conversation()
        for call in range(CALLS):
            conversation.call(pair[(call // 3) % 2].url)  # three calls here, three there
        moved = sent(upstream)

    assert len(moved) == CALLS
    assert same_tenant([r.replace(bucket, reference_bucket) for r in moved]) == same_tenant(
        reference
    )
    # the budget did work on every worker: results persisted, their objects in the bucket
    last = json.loads(moved[-1])
    persisted = {k: v for k, v in results_of(last).items() if v.startswith(TAG)}
    assert len(persisted) > 50
    where = conversation_key(fleet_store.store(bucket))
    objects = keys_of(fleet_store.store(bucket), f"{where}/tool-results")
    assert len(objects) == len(persisted)
    for tool_use_id, text in persisted.items():
        shown_path = re.escape(f"{fleet_store.url(bucket, where)}/tool-results/{tool_use_id}.")
        assert re.search(shown_path + r"[0-9a-f]{12}\.txt\n", text), text[:200]
    # each worker served its calls (its log says so) and every call's response was recorded
    # in the fleet's records, whichever worker served it
    expected = [sum(1 for c in range(CALLS) if (c // 3) % 2 == k) for k in (0, 1)]
    for _ in range(100):  # a request's line comes once its client has the response
        served = [
            sum("wire.request" in line and "status=200" in line for line in w.lines) for w in pair
        ]
        if served == expected:
            break
        time.sleep(0.1)
    assert served == expected
    records = keys_of(fleet_store.store(bucket), f"{where}/records")
    assert len(records) >= CALLS
    # and their snapshots: a chain reaching the last record (written after each response)
    from pipeline.store.object_snapshots import choose_chain

    directory = f"{where}/records-snapshots"
    # the last call's is written after its response, by a worker that may wait for a CPU on a
    # busy machine: as long a wait as for the log lines above
    for _ in range(100):
        chain = choose_chain(keys_of(fleet_store.store(bucket), directory), directory)
        if chain is not None and chain.last == len(records) - 1:
            break
        time.sleep(0.1)
    assert chain is not None and chain.last == len(records) - 1


# ---------------------------------------------------------------------------------------------
# (b) two workers persist the same result at once
# ---------------------------------------------------------------------------------------------


def at_once(conversation: Conversation, urls: list[str]) -> None:
    """The conversation's next request sent to every one of ``urls`` at the same moment (a
    client retrying on another worker while the first still works on it); none may fail."""
    history = list(conversation.messages)
    gate = threading.Barrier(len(urls))
    failures: list[BaseException] = []

    def send(url: str) -> None:
        try:
            gate.wait(timeout=30)
            conversation.client(url).messages.create(
                model="m",
                max_tokens=10,
                messages=history,  # type: ignore[arg-type]
            )
        except BaseException as exc:  # reported in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=send, args=(url,)) for url in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures, failures


def test_two_workers_taking_the_same_request_at_once_persist_one_object(
    fleet_store: Server, workers: Callable[..., list[Worker]], tmp_path: Path
) -> None:
    bucket = fleet_store.new_bucket()
    with ScriptedMessagesServer(script) as upstream:
        pair = workers(
            2, upstream.base_url, fleet_store.url(bucket, PREFIX), worker_env(fleet_store), tmp_path
        )
        conversation = Conversation()
        conversation.call(pair[0].url)  # the prompt: nothing to persist yet
        for _turn in range(3):
            at_once(conversation, [w.url for w in pair])
            first, second = upstream.requests[-2:]
            assert json.dumps(first) == json.dumps(second)  # both sent the same bytes
            conversation.call(pair[1].url)  # the conversation goes on
        requests = upstream.requests

    shown = {k: v for k, v in results_of(requests[-1]).items() if v.startswith(TAG)}
    assert len(shown) == 6  # the two largest of three turns
    store = fleet_store.store(bucket)
    where = conversation_key(store)
    objects = keys_of(store, f"{where}/tool-results")
    # one object per result, under its content's name: no second object for a racing write
    named = [re.fullmatch(r"(.+)\.[0-9a-f]{12}\.txt", k.rsplit("/", 1)[1]) for k in objects]
    assert sorted(m.group(1) for m in named if m) == sorted(shown) and len(named) == len(shown)
    sizes = dict(zip(("0", "1", "2"), SIZES, strict=True))
    for key in objects:
        tool_use_id = key.rsplit("/", 1)[1].split(".", 1)[0]
        expected = output(tool_use_id, sizes[tool_use_id[-1]])
        assert bytes(store.get(key).bytes()) == expected.encode()


# ---------------------------------------------------------------------------------------------
# (c) the store goes away mid-session and comes back
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_a_store_outage_never_fails_a_call_and_the_session_stays_consistent(
    kind: str, workers: Callable[..., list[Worker]], tmp_path: Path
) -> None:
    moto = start_server(kind, tmp_path)  # its own server: stopped and started again below
    bucket = moto.new_bucket()
    up, down = range(0, 5), range(5, 8)
    with ScriptedMessagesServer(script) as upstream:
        first, second = workers(
            2, upstream.base_url, moto.url(bucket, PREFIX), worker_env(moto), tmp_path
        )
        conversation = Conversation()
        try:
            for _ in up:
                conversation.call(first.url)
            moto.stop()  # the store is unreachable from here
            for _ in down:
                conversation.call(first.url)  # the calls go on: no error reaches the client
            moto = moto.again()  # the store is back, with what it held
            time.sleep(COOL_DOWN + 0.2)  # the workers ask it again
            for _ in range(8, 12):
                conversation.call(first.url)
            conversation.call(second.url)  # a worker that never served this conversation
            moto_store = moto.store(bucket)
            stored_keys = keys_of(moto_store, PREFIX)
        finally:
            moto.stop()
        requests = upstream.requests

    assert len(requests) == 13
    # every request through the first worker starts with the previous one: the outage changed
    # nothing the model had already seen
    for k in range(1, 12):
        before = requests[k - 1]["messages"]
        assert requests[k]["messages"][: len(before)] == before, k
    # during the outage the results over the budget were persisted all the same: to the
    # worker's spool, under the names the store would have given them
    spooled: set[str] = set()
    for k in down:
        newest = requests[k]["messages"][-1]["content"]
        if len(newest) > 1:  # a turn over the budget
            over = [b for b in newest if len(b["content"]) > SIZES[0]]
            assert over and all(b["content"].startswith(TAG) for b in over)
            spooled.update(b["tool_use_id"] for b in over)
    assert len(spooled) == 6  # the two largest of the three turns answered in the outage
    # after it, persisting works again, and the spool has reached the store
    assert requests[11]["messages"][-1]["content"][-1]["content"].startswith(TAG)
    stored = [key for key in stored_keys if "/tool-results/" in key]
    assert all(any(f"/{tid}." in key for key in stored) for tid in spooled)

    # a worker that never served the conversation takes it over: the decisions whose records
    # could not be written (results before the last response) it makes again, alike
    before, after = results_of(requests[11]), results_of(requests[12])
    assert all(after[k] == before[k] for k in before)
    assert requests[12]["messages"][: len(requests[11]["messages"])] == requests[11]["messages"]

    told = first.stderr
    assert "stage_record.write_failed" in told  # each failed append is logged...
    assert "store.spooled" in told  # ...each result spooled...
    assert "wire_session.refresh_failed" in told  # ...and each listing that could not be made
    assert SECRET_KEY not in told + second.stderr  # ...without the credentials
    assert "Traceback" not in told


# ---------------------------------------------------------------------------------------------
# (d) every worker restarted mid-session
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_worker_killed_and_replaced_mid_session_changes_nothing(
    fleet_store: Server,
    alone: tuple[str, list[str]],
    workers: Callable[..., list[Worker]],
    tmp_path: Path,
) -> None:
    reference_bucket, reference = alone
    bucket = fleet_store.new_bucket()
    store = fleet_store.url(bucket, PREFIX)
    calls, restart_at = 24, 12
    with ScriptedMessagesServer(script) as upstream:
        env = worker_env(fleet_store)
        pair = workers(2, upstream.base_url, store, env, tmp_path / "before")
        conversation = Conversation()
        for call in range(calls):
            if call == restart_at:
                for worker in pair:
                    worker.kill()  # SIGKILL: no graceful anything
                # new hosts: nothing local survives either
                pair = workers(2, upstream.base_url, store, env, tmp_path / "after")
            conversation.call(pair[(call // 3) % 2].url)
        restarted = sent(upstream)

    restarted = [r.replace(bucket, reference_bucket) for r in restarted]
    assert same_tenant(restarted) == same_tenant(reference[:calls])
    assert TAG in restarted[restart_at]


# ---------------------------------------------------------------------------------------------
# what a worker learns from the others, and what it cannot: two proxies in this process on one
# in-memory store, each through a wrapper that can fail one worker's writes
# ---------------------------------------------------------------------------------------------


class Faults:
    """A worker's store faults: a put whose key ``failing`` accepts raises ``OSError``."""

    def __init__(self) -> None:
        self.failing: Callable[[str], bool] = lambda _key: False

    def before_put(self, path: str, *_args: Any, **_kwargs: Any) -> None:
        if self.failing(path):
            raise OSError("injected store fault")


def in_process_pair(
    tmp_path: Path, upstream: str, memory: Any, *, spools: bool = False
) -> tuple[Faults, QuietLogger, list[Any]]:
    """Two proxies (context managers, not entered) sharing ``memory``; the second one's puts
    go through :class:`Faults`, its events to the logger returned; ``spools``: each with a
    spool (as the command's workers are)."""
    faults, logger = Faults(), QuietLogger()

    def budget() -> Pipeline:
        return Pipeline([ToolResultBudget(limit=int(PER_MESSAGE))])

    shared = "memory:///" + PREFIX
    first = proxy(
        upstream,
        tmp_path / "a",
        budget,
        storage=SessionStates(
            shared, object_store=Wrapped(memory), spool=tmp_path / "a-spool" if spools else None
        ),
        logger=QuietLogger(),
    )
    second = proxy(
        upstream,
        tmp_path / "b",
        budget,
        storage=SessionStates(
            shared,
            object_store=Wrapped(memory, before={"put": faults.before_put}),
            spool=tmp_path / "b-spool" if spools else None,
        ),
        logger=logger,
    )
    return faults, logger, [first, second]


def test_a_worker_serving_again_first_learns_what_another_decided(tmp_path: Path) -> None:
    """The second worker cannot persist one result (a fault on its put only) and sends it
    whole, recording that; when the conversation comes back to the first worker, that worker
    knows it (it lists what others recorded, and loads again) and sends it whole too, where on
    its own it would persist it."""
    from obstore.store import MemoryStore

    once = "/tool-results/toolu_04_2."
    with ScriptedMessagesServer(script) as upstream:
        faults, _logger, pair = in_process_pair(tmp_path, upstream.base_url, MemoryStore())
        with pair[0] as a, pair[1] as b:
            conversation = Conversation()
            for call in range(9):
                failing = (lambda key: once in key) if call == 5 else (lambda _key: False)
                faults.failing = failing
                conversation.call((a, b)[(call // 3) % 2])
        requests = upstream.requests
    assert results_of(requests[5])["toolu_04_2"] == output("toolu_04_2", SIZES[2])
    for k in range(1, 9):
        before = requests[k - 1]["messages"]
        assert requests[k]["messages"][: len(before)] == before, k


def test_a_decision_whose_record_was_lost_is_made_again_alike_by_the_next_worker(
    tmp_path: Path,
) -> None:
    """The second worker persists two results but cannot record it (its record writes fail
    for that call). The first worker, serving the next call, finds no record of those results
    in a conversation whose records show it served calls: a record lost, not a result sent
    before this layer. With spools (a persist never falls back to whole) it decides them again,
    as the second did (the decision depends on the results and their message alone): the model
    never sees them change form. Before, it counted them as sent whole and sent them in full."""
    from obstore.store import MemoryStore

    with ScriptedMessagesServer(script) as upstream:
        faults, logger, pair = in_process_pair(
            tmp_path, upstream.base_url, MemoryStore(), spools=True
        )
        with pair[0] as a, pair[1] as b:
            conversation = Conversation()
            for call in range(8):
                records = (lambda key: "/records/" in key) if call == 5 else (lambda _key: False)
                faults.failing = records
                conversation.call((a, b)[(call // 3) % 2])
        requests = upstream.requests
    before, after = results_of(requests[5]), results_of(requests[6])
    assert before["toolu_04_1"].startswith(TAG) and before["toolu_04_2"].startswith(TAG)
    assert {k for k in before if before[k] != after[k]} == set()
    for k in range(1, 8):
        previous = requests[k - 1]["messages"]
        assert requests[k]["messages"][: len(previous)] == previous, k
    failed = [kw for level, event, kw in logger.events if event == "stage_record.write_failed"]
    assert failed and all(kw["error"] == "StoreError" for kw in failed)


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_is_recorded_before_the_client_can_act_on_it(
    tmp_path: Path, stream: bool
) -> None:
    """The next call may go to another worker the moment the client has the response -- for
    an impatient client, the moment it has read ``message_delta`` (the final usage) or a
    complete JSON body, before the body's end: the response's record (id and usage) must be in
    the store by then, even when writing it is slow."""
    from obstore.store import MemoryStore

    from pipeline.store.object_records import ObjectRecordLog

    memory = MemoryStore()

    def slow_response_records(path: str, data: bytes, **_kwargs: Any) -> None:
        if b"wire_session.response" in data:
            time.sleep(0.3)

    def recorded() -> list[Any]:
        tenant_prefix, name = conversation_key(memory).rsplit("/", 1)
        loaded = ObjectRecordLog(memory, prefix=tenant_prefix, session_id=name).load()
        stages = loaded.stage_records if loaded is not None else []
        return [r.data["id"] for r in stages if r.stage == "wire_session.response"]

    states = SessionStates(
        f"memory:///{PREFIX}",
        object_store=Wrapped(memory, before={"put": slow_response_records}),
    )
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "read the job logs"}],
        "stream": stream,
    }
    headers = {SESSION_HEADER: SID, "x-api-key": "k", "anthropic-version": "2023-06-01"}
    with (
        ScriptedMessagesServer(script) as upstream,
        proxy(
            upstream.base_url,
            tmp_path,
            lambda: Pipeline([ToolResultBudget(limit=int(PER_MESSAGE))]),
            storage=states,
        ) as url,
        httpx2.Client(timeout=30) as client,
        client.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        seen = b""
        for chunk in response.iter_bytes():
            seen += chunk
            if stream and b'"message_delta"' in seen:
                break  # the usage is final: a client may move on from here
            if not stream:
                with contextlib.suppress(ValueError):
                    json.loads(seen)
                    break  # the whole message: a client may move on from here
        else:
            pytest.fail("the response ended without its usage")
        ids = recorded()  # before anything more is read
    reply = re.search(rb'"id": ?"(msg_[A-Za-z0-9_]+)"', seen)
    assert reply is not None
    assert ids == [reply.group(1).decode()]


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def test_the_proxy_refuses_what_an_object_store_cannot_do(tmp_path: Path) -> None:
    proc = run_cli("proxy", "--store", "s3://some-bucket/fleet", "--retain", "7d")
    assert proc.returncode == 2
    assert "lifecycle rules" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("proxy", "--store", "memory:///fleet")
    assert proc.returncode == 2 and "s3://BUCKET/PREFIX" in proc.stderr
    proc = run_cli("proxy", "--store", "s3://AKIDX:hunter2@bucket/x")
    assert proc.returncode == 2 and "hunter2" not in proc.stderr
    proc = run_cli("proxy", "--store", str(tmp_path), "--store-timeout", "2")
    assert proc.returncode == 2 and "apply to an s3:// or az:// --store" in proc.stderr
    proc = run_cli("proxy", "--store", "s3://bucket/x", "--store-retries", "11")
    assert proc.returncode == 2 and "--store-retries" in proc.stderr


def test_a_worker_starts_and_serves_while_the_store_is_unreachable(
    workers: Callable[..., list[Worker]], tmp_path: Path
) -> None:
    moto = start_moto()
    bucket = moto.new_bucket()
    env = worker_env(moto)
    moto.stop()  # nothing answers at the endpoint from the start
    with ScriptedMessagesServer(script) as upstream:
        (worker,) = workers(1, upstream.base_url, f"s3://{bucket}/{PREFIX}", env, tmp_path)
        conversation = Conversation()
        for _ in range(3):
            conversation.call(worker.url)  # sent as the client sent it: nothing to read
        requests = upstream.requests
    assert "does not answer now" in worker.stderr and SECRET_KEY not in worker.stderr
    assert "wire_session.load_failed" in worker.stderr
    assert all(TAG not in json.dumps(r) for r in requests)
    assert requests[-1]["messages"] == conversation.messages[:-2]  # as the client sent it


def test_record_snapshots_on_the_store_replace_each_other_and_load_as_the_records(
    fleet_store: Server,
) -> None:
    """On S3 (moto) and Azure (Azurite): every compaction a new base, the older ones removed in
    one batch but the chain just replaced; a new reader starts from the newest and loads what
    the records give."""
    from pipeline.store.object_records import ObjectRecordLog
    from pipeline.store.object_snapshots import snapshots_dir

    store = fleet_store.store(fleet_store.new_bucket())

    def log(writer: str) -> ObjectRecordLog:
        return ObjectRecordLog(
            store, prefix=PREFIX, session_id="snaps", writer_id=writer, delta_bytes=0
        )

    writer = log("a")
    for k in range(4):
        writer.append_stage_record("response", {"index": k, "id": f"msg_{k}"})
        writer.compact()
    directory = snapshots_dir(writer.layout.records_dir)
    left = [key.rsplit("/", 1)[1] for key in keys_of(store, directory)]
    assert left == ["000000000000-000000000002.jsonl", "000000000000-000000000003.jsonl"]
    loaded = log("b").load()
    assert loaded is not None
    assert [r.data["index"] for r in loaded.stage_records] == [0, 1, 2, 3]
