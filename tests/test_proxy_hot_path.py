"""What stands between a client and its response at the proxy: only what must. The request's
end (its span, metrics and log line) comes after the client has the whole response; the
server's garbage collector is set for a long-lived process, and set back when it stops."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from pipeline import Pipeline
from pipeline._cli.proxy_cmd import SERVER_GC_THRESHOLDS, server_collector
from pipeline.testing import QuietLogger, Reply, ScriptedMessagesServer
from stages import ToolResultBudget
from tests.wire_support import proxy


def _reply(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def _budget() -> Pipeline:
    return Pipeline([ToolResultBudget()])


class _EndsAfterTheClient(QuietLogger):
    """A logger whose request line waits (5 s at most) for the client to hold its response,
    and keeps whether it did."""

    def __init__(self) -> None:
        super().__init__()
        self.client_has_it = threading.Event()
        self.in_time: list[bool] = []

    def info(self, event: str, **kw: Any) -> None:
        if event == "wire.request":
            self.in_time.append(self.client_has_it.wait(5))
        super().info(event, **kw)


@pytest.mark.parametrize("calls", [1, 3])
def test_a_client_holds_its_whole_response_before_the_request_ends(
    tmp_path: Path, calls: int
) -> None:
    logger = _EndsAfterTheClient()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    with (
        ScriptedMessagesServer(_reply) as upstream,
        proxy(upstream.base_url, tmp_path, _budget, logger=logger) as url,
        httpx2.Client(timeout=30) as client,
    ):
        for k in range(calls):  # one kept-alive connection: the next request follows at once
            logger.client_has_it.clear()
            body = {"model": "m", "max_tokens": 5, "messages": messages}
            answer = client.post(f"{url}/v1/messages", json=body)
            logger.client_has_it.set()
            assert answer.status_code == 200
            assert answer.json()["content"] == [{"type": "text", "text": "ok"}]
            deadline = time.monotonic() + 10
            while len(logger.in_time) <= k:
                assert time.monotonic() < deadline, "the request never ended"
                time.sleep(0.01)
            messages = [
                *messages,
                {"role": "assistant", "content": answer.json()["content"]},
                {"role": "user", "content": f"again {k}"},
            ]
    assert logger.in_time == [True] * calls


def test_the_server_collector_freezes_start_up_and_is_set_back() -> None:
    saved = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with server_collector():
        assert gc.get_threshold() == SERVER_GC_THRESHOLDS
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == saved
    assert gc.get_freeze_count() == 0
