"""A store that failed is not asked again for a cool-down: calls go on without it at once, one
call probes it afterwards, and an answer (nothing there, already there) is not a failure."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anthropic
import pytest

pytest.importorskip("obstore")

from obstore.store import MemoryStore

from pipeline import Pipeline
from pipeline.store.breaker import StoreBreaker
from pipeline.store.files import StoreError
from pipeline.store.sessions import SessionStates
from pipeline.testing import Reply, ScriptedMessagesServer
from stages import default_stages
from tests.objectstore_support import Outage, Wrapped
from tests.wire_support import proxy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_after_a_failure_calls_fail_at_once_without_reaching_the_store() -> None:
    down, clock = Outage(message="timed out"), Clock()
    inner = Wrapped(MemoryStore(), before={"put": down, "get": down, "list": down})
    breaker = StoreBreaker(inner, cool_down=10, clock=clock)
    for _ in range(3):  # quick failures: the third in a row finds it down
        assert not breaker.open
        with pytest.raises(OSError, match="timed out"):
            breaker.put("a", b"1")
    assert breaker.open
    for _ in range(5):
        with pytest.raises(StoreError, match="not asked again for 10 s"):
            breaker.get("a")
        with pytest.raises(StoreError):
            list(breaker.list("x"))
    assert inner.calls == {"put": 3}  # none of the ten reached it
    assert breaker.skipped == 10


def test_one_quick_failure_does_not_open_it_one_slow_one_does() -> None:
    down, clock = Outage(message="timed out"), Clock()

    def slowly(*args: Any, **kwargs: Any) -> None:
        clock.now += 1.5  # as long as a timeout takes
        down(*args, **kwargs)

    inner = Wrapped(MemoryStore(), before={"put": down, "get": slowly})
    breaker = StoreBreaker(inner, cool_down=10, clock=clock)
    with pytest.raises(OSError):
        breaker.put("a", b"1")
    down.down = False
    breaker.put("a", b"1")  # a transient error costs only the write it hit
    assert not breaker.open
    down.down = True
    with pytest.raises(OSError, match="timed out"):
        breaker.get("a")
    assert breaker.open


def test_after_the_cool_down_one_call_probes_and_its_success_closes() -> None:
    down, clock = Outage(message="timed out"), Clock()
    inner = Wrapped(MemoryStore(), before={"put": down})
    breaker = StoreBreaker(inner, cool_down=10, failures=1, clock=clock)
    with pytest.raises(OSError):
        breaker.put("a", b"1")
    clock.now += 10
    with pytest.raises(OSError, match="timed out"):  # the probe, still down: open again
        breaker.put("a", b"1")
    assert inner.calls["put"] == 2
    with pytest.raises(StoreError):
        breaker.put("a", b"1")
    down.down = False
    clock.now += 10
    breaker.put("a", b"1")  # the probe answers
    assert not breaker.open
    breaker.put("b", b"2")
    assert bytes(breaker.get("b").bytes()) == b"2"
    assert inner.calls["put"] == 4


def test_answers_are_not_failures() -> None:
    breaker = StoreBreaker(MemoryStore(), cool_down=10)
    with pytest.raises(FileNotFoundError):
        breaker.get("missing")
    breaker.put("k", b"1", mode="create")
    with pytest.raises(Exception) as caught:
        breaker.put("k", b"2", mode="create")
    assert not isinstance(caught.value, StoreError)
    assert not breaker.open
    assert [m["path"] for batch in breaker.list() for m in batch] == ["k"]


def test_a_cool_down_is_a_number_of_seconds() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="cool_down"):
            StoreBreaker(MemoryStore(), cool_down=bad)
        with pytest.raises(ValueError, match="slow"):
            StoreBreaker(MemoryStore(), slow=bad)
    with pytest.raises(ValueError, match="failures"):
        StoreBreaker(MemoryStore(), failures=0)


def test_a_hanging_store_costs_the_proxy_one_wait_not_one_per_call(tmp_path: Path) -> None:
    """Every store call hangs (a delay, then a failure) while the store is down: the proxy
    answers every call, and only the first call's store requests wait on it."""
    hung: list[float] = []

    def hang(*_args: Any, **_kwargs: Any) -> None:
        hung.append(time.monotonic())
        time.sleep(1.1)  # longer than a failure the breaker lets pass
        raise OSError("timed out")

    hooks = {name: hang for name in ("put", "get", "head", "list", "list_with_delimiter")}
    store = Wrapped(MemoryStore(), before=hooks)
    states = SessionStates("memory:///fleet", object_store=store, cool_down=600)

    def reply(_body: dict[str, Any]) -> Reply:
        return Reply([{"type": "text", "text": "ok"}])

    with (
        ScriptedMessagesServer(reply) as upstream,
        proxy(
            upstream.base_url, tmp_path, lambda: Pipeline(default_stages()), storage=states
        ) as url,
    ):
        client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "go"}]
        for k in range(6):
            client.messages.create(model="m", max_tokens=5, messages=messages)
            call = {"type": "tool_use", "id": f"t{k}", "name": "x", "input": {}}
            result = {"type": "tool_result", "tool_use_id": f"t{k}", "content": "y" * 60_000}
            messages += [
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
            ]
    assert len(upstream.requests) == 6  # no call failed
    assert len(hung) == 1, f"the store was waited on {len(hung)} times"


class LazyDown:
    """A store whose listing is lazy, as obstore's is: asking succeeds, reading fails."""

    def __init__(self) -> None:
        self.reads = 0

    def list(self, prefix: str | None = None, *, offset: str | None = None) -> Any:
        def batches() -> Any:
            self.reads += 1
            raise OSError("timed out")
            yield []  # a generator

        return batches()


def test_a_lazy_listing_is_a_probe_only_once_read() -> None:
    clock, inner = Clock(), LazyDown()
    breaker = StoreBreaker(inner, cool_down=10, clock=clock)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(OSError):
            list(breaker.list("x"))
    clock.now += 10
    with pytest.raises(OSError):  # the probe: the listing's first read fails
        list(breaker.list("x"))
    assert breaker.open
    for _ in range(3):
        with pytest.raises(StoreError):
            list(breaker.list("x"))
    assert inner.reads == 4
