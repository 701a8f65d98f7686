"""What an operator sees of ``python -m pipeline proxy`` run as a process: its spans and metrics
exported over OTLP to a real receiver, one log line per request (JSON when asked), a failure
included."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from pipeline.dropin.held_families import held_size
from pipeline.testing import Reply, ScriptedMessagesServer
from tests.builders import tool_result, tool_use
from tests.otlp_receiver import OtlpReceiver, ReceivedPoint
from tests.wire_support import CutUpstream, free_port, proxy_process

pytest.importorskip("uvicorn", reason="the proxy extra is not installed")

TAG = "<persisted-output>"


def reply(body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def build(output: str, tid: str = "toolu_01") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "run the build"},
        {"role": "assistant", "content": [tool_use(tid)]},
        {"role": "user", "content": [tool_result(tid, output)]},
    ]


def total(points: list[ReceivedPoint], metric: str, **attrs: Any) -> tuple[float, int]:
    """The last (cumulative) value and count of ``metric`` for the points whose attributes
    include ``attrs``, summed over attribute sets."""
    last: dict[str, ReceivedPoint] = {}
    for p in points:
        if p.metric == metric and all(p.attributes.get(k) == v for k, v in attrs.items()):
            last[json.dumps(p.attributes, sort_keys=True)] = p
    return sum(p.value for p in last.values()), sum(p.count for p in last.values())


def test_the_proxy_exports_its_spans_and_metrics_and_logs_each_request(tmp_path: Path) -> None:
    with (
        OtlpReceiver() as receiver,
        ScriptedMessagesServer(reply) as upstream,
        proxy_process(
            upstream.base_url,
            tmp_path / "store",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_METRIC_EXPORT_INTERVAL="200",
            OTEL_BSP_SCHEDULE_DELAY="100",
        ) as (url, lines, code),
    ):
        client = anthropic.Anthropic(base_url=url, api_key="sk-ant-op", max_retries=0)
        client.messages.create(model="claude-test", max_tokens=10, messages=build("x" * 60_000))
        with client.messages.stream(
            model="claude-test", max_tokens=10, messages=build("x" * 60_000)
        ) as stream:
            stream.get_final_message()
        client.messages.count_tokens(model="claude-test", messages=build("small"))  # as it is
        client.close()
    assert code == [0]
    spans = receiver.spans
    requests = [s for s in spans if s.name == "wire.request"]
    assert len(requests) == 2
    assert len({s.trace_id for s in requests}) == 2  # one kept-alive connection, two traces
    by_id = {s.span_id: s for s in spans}
    (persist,) = [s for s in spans if s.name == "tool_result_budget.persist"]
    parent, chain = by_id.get(persist.parent_span_id), []
    while parent is not None:
        chain.append(parent.name)
        parent = by_id.get(parent.parent_span_id)
    assert chain[-1] == "wire.request"  # the decision under the request that made it
    for span in requests:
        attributes = span.attributes
        assert attributes["gen_ai.request.model"] == "claude-test"
        assert attributes["gen_ai.response.id"].startswith("msg_")
        cached = attributes.get("gen_ai.usage.cache_read.input_tokens", 0) + attributes.get(
            "gen_ai.usage.cache_creation.input_tokens", 0
        )
        assert attributes["gen_ai.usage.input_tokens"] >= cached > 0  # cached ones included
        assert attributes["gen_ai.usage.output_tokens"] > 0
        assert "gen_ai.usage.cache_read.input_tokens" in attributes
        assert attributes["http.response.status_code"] == 200
        assert attributes["sluicegate.upstream.duration_ms"] >= 0
        assert (
            attributes["sluicegate.request.chars_out"] < attributes["sluicegate.request.chars_in"]
        )
    assert {s.attributes["gen_ai.request.stream"] for s in requests} == {False, True}
    # the upstream call in the request's waterfall: after its pass, within the request
    for span in requests:
        (call,) = [
            s for s in spans if s.name == "wire.upstream" and s.parent_span_id == span.span_id
        ]
        (passed,) = [
            s for s in spans if s.name == "pipeline.run" and s.parent_span_id == span.span_id
        ]
        assert passed.end_ns <= call.start_ns <= call.end_ns <= span.end_ns
        assert call.attributes["http.response.status_code"] == 200 and call.status == "UNSET"
        for ids in ("gen_ai.conversation.id", "sluicegate.call"):  # as every span of the call
            assert call.attributes[ids] == span.attributes[ids]
        assert not any("x" * 100 in str(v) for v in call.attributes.values())
    points = receiver.points
    answered = {"http.response.status_code": 200, "http.route": "/v1/messages"}
    assert total(points, "http.server.request.duration", **answered)[1] == 2
    assert total(points, "gen_ai.client.token.usage", **{"gen_ai.token.type": "output"})[1] == 2
    assert total(points, "sluicegate.tool_results.persisted")[0] == 1  # the second re-applied
    assert total(points, "sluicegate.chars.kept_off_wire")[0] > 2 * 50_000
    assert total(points, "gen_ai.client.operation.duration")[1] == 2
    assert total(points, "sluicegate.pipeline.duration")[1] == 2
    logged = [line for line in lines if "wire.request" in line]
    relayed = [line for line in logged if "path=" in line]
    assert len(relayed) == 1 and "path=/v1/messages/count_tokens" in relayed[0], logged
    assert "status=200" in relayed[0] and "method=POST" in relayed[0]
    route = {"http.route": "/{path:path}"}
    assert total(points, "http.server.request.duration", **route)[1] == 1
    logged = [line for line in logged if line not in relayed]
    assert len(logged) == 2, lines
    assert all("status=200" in line and "session_id=" in line for line in logged)
    assert "persisted=1" in logged[0] and "reapplied=1" in logged[1]
    assert not any("x" * 100 in line for line in lines)  # no content in a log line
    # each request's line names its own trace and span: an operator goes from it to its trace
    for span in requests:
        (line,) = [x for x in logged if f"response_id={span.attributes['gen_ai.response.id']}" in x]
        assert f"trace_id={span.trace_id}" in line and f"span_id={span.span_id}" in line, line


def _spans_only(
    upstream: str, tmp_path: Path, receiver: OtlpReceiver
) -> AbstractContextManager[tuple[str, list[str], list[int]]]:
    """The proxy process logging JSON lines and exporting its spans (no metrics) to
    ``receiver`` within a tenth of a second."""
    return proxy_process(
        upstream,
        tmp_path / "store",
        "--log-json",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRICS_EXPORTER="none",
    )


def test_an_unreachable_upstream_is_one_logged_failure_and_json_lines_stay_json(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with (
        OtlpReceiver() as receiver,
        _spans_only(dead, tmp_path, receiver) as (url, lines, code),
    ):
        client = anthropic.Anthropic(base_url=url, api_key="sk-ant-op", max_retries=0)
        with pytest.raises(anthropic.InternalServerError):
            client.messages.create(model="m", max_tokens=10, messages=build("small"))
        client.close()
    (call,) = [s for s in receiver.spans if s.name == "wire.upstream"]
    assert call.status == "ERROR" and call.attributes["error.type"] == "ConnectError"
    assert "http.response.status_code" not in call.attributes  # it never answered
    records = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
    assert records[0]["event"] == "proxy.listening" and records[0]["url"] == url
    (failed,) = [r for r in records if r.get("event") == "wire.request"]
    assert failed["status"] == 502 and failed["error"] == "ConnectError"
    assert failed["level"] == "warning" and "session_id" in failed
    assert records[-1]["event"] == "proxy.stopped"  # SIGINT: a graceful stop, logged
    assert code == [0]


def _scrape(port: int, wanted: str) -> dict[str, str]:
    """The proxy's Prometheus page once it shows ``wanted``: each sample's name -> its line."""
    deadline = time.monotonic() + 10
    while True:  # a request's metrics come after the client has the response
        with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10) as got:
            page = got.read().decode()
        if wanted in page:
            break
        assert time.monotonic() < deadline, f"{wanted} never came"
        time.sleep(0.05)
    return {
        line.split("{")[0].split(" ")[0]: line
        for line in page.splitlines()
        if line and not line.startswith("#")
    }


@contextmanager
def _prometheus_proxy(tmp_path: Path, *extra: str) -> Iterator[tuple[str, int, list[int]]]:
    """The proxy command (``extra``: its options) with its metrics served for scraping: its
    URL, the scrape port, and its exit code once it has stopped."""
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the prometheus extra")
    scrape = free_port()
    with (
        ScriptedMessagesServer(reply) as upstream,
        proxy_process(
            upstream.base_url,
            tmp_path / "store",
            *extra,
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(scrape),
        ) as (url, _, code),
    ):
        yield url, scrape, code


def test_prometheus_scrapes_the_proxys_metrics(tmp_path: Path) -> None:
    with _prometheus_proxy(tmp_path) as (url, scrape, code):
        client = anthropic.Anthropic(base_url=url, api_key="sk-ant-op", max_retries=0)
        client.messages.create(model="claude-test", max_tokens=10, messages=build("x" * 60_000))
        client.close()
        samples = _scrape(scrape, "http_server_request_duration_seconds_count")
    assert code == [0]
    assert (
        'http_response_status_code="200"' in samples["http_server_request_duration_seconds_count"]
    )
    assert samples["sluicegate_tool_results_persisted_total"].endswith(" 1.0")
    assert "gen_ai_client_token_usage_count" in " ".join(samples)
    assert "sluicegate_chars_kept_off_wire_total" in samples


def test_the_conversations_held_are_gauged_and_bounded_by_their_size(tmp_path: Path) -> None:
    """``--max-held-size``: past it, the conversation least recently used is let go; the
    gauges say how many are held and what their last requests come to (each its body's bytes
    and 2 KiB a message)."""
    with _prometheus_proxy(tmp_path, "--max-held-size", "5000") as (url, scrape, code):
        client = anthropic.Anthropic(base_url=url, api_key="sk-ant-op", max_retries=0)
        sizes = []
        for task in ("build the docs", "run the tests"):
            messages = [{"role": "user", "content": task}]
            sent = {"max_tokens": 10, "messages": messages, "model": "m"}
            raw = json.dumps(sent, separators=(",", ":"))  # as the SDK writes it
            sizes.append(held_size(len(raw), len(messages)))
            client.messages.create(model="m", max_tokens=10, messages=messages)
        first = _scrape(scrape, "sluicegate_conversations_held")
        client.messages.create(model="m", max_tokens=10, messages=build("y" * 2_000))
        client.close()
        second = _scrape(scrape, "sluicegate_conversations_held")
    assert code == [0]

    def value(samples: dict[str, str], name: str) -> float:
        return float(samples[name].rsplit(" ", 1)[1])

    # two small conversations of ~2,100 under 5,000; a third of ~4,100 or more goes past it
    assert value(first, "sluicegate_conversations_held") == 2
    assert value(first, "sluicegate_conversations_held_size_bytes") == sum(sizes)
    assert value(second, "sluicegate_conversations_held") == 1
    assert value(second, "sluicegate_conversations_held_size_bytes") > 4_000


def test_a_request_with_a_traceparent_joins_its_clients_trace(tmp_path: Path) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with (
        OtlpReceiver() as receiver,
        ScriptedMessagesServer(reply) as upstream,
        proxy_process(
            upstream.base_url,
            tmp_path / "store",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
        ) as (url, _, _),
    ):
        client = anthropic.Anthropic(base_url=url, api_key="sk-ant-op", max_retries=0)
        client.messages.create(
            model="claude-test",
            max_tokens=10,
            messages=build("small"),
            extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        )
        client.messages.create(model="claude-test", max_tokens=10, messages=build("small"))
        client.close()
    joined, own = [s for s in receiver.spans if s.name == "wire.request"]
    assert (joined.trace_id, joined.parent_span_id) == (trace_id, parent)
    assert own.trace_id != trace_id and not own.parent_span_id


@pytest.mark.parametrize("path", ["/v1/models", "/v1/messages/count_tokens"])
def test_a_relayed_body_the_upstream_cuts_is_logged_as_a_failure(tmp_path: Path, path: str) -> None:
    """A request relayed as it is (another path) whose body the upstream cuts after its 200
    is a warning with the error's type, not a request that went well."""
    upstream = CutUpstream(json=True)
    try:
        with (
            proxy_process(upstream.url, tmp_path / "store", "--log-json") as (url, lines, _),
            pytest.raises(httpx2.RemoteProtocolError),
            httpx2.stream("POST", f"{url}{path}", json={"model": "m"}) as answer,
        ):
            answer.read()
    finally:
        upstream.sock.close()
    records = [json.loads(line) for line in lines if line.strip()]
    (told,) = [r for r in records if r.get("event") == "wire.request"]
    assert told["level"] == "warning" and told["error"] == "RemoteProtocolError"
    assert told["status"] == 200 and told["path"] == path


@pytest.mark.parametrize("json_body", [False, True], ids=["event-stream", "json"])
def test_a_body_the_upstream_cuts_after_its_status_fails_the_upstream_span(
    tmp_path: Path, json_body: bool
) -> None:
    """The upstream answers 200 and breaks off in its body: its span and the request's say
    so (the error's type), and the request's log line is a warning, not a 200 that went
    well."""
    upstream = CutUpstream(json=json_body)
    try:
        with (
            OtlpReceiver() as receiver,
            _spans_only(upstream.url, tmp_path, receiver) as (url, lines, _code),
        ):
            body = {"model": "m", "max_tokens": 10, "messages": build("small")}
            with (
                pytest.raises(httpx2.RemoteProtocolError),  # as without the proxy
                httpx2.stream("POST", f"{url}/v1/messages", json=body) as answer,
            ):
                answer.read()
    finally:
        upstream.sock.close()
    (call,) = [s for s in receiver.spans if s.name == "wire.upstream"]
    assert call.attributes["http.response.status_code"] == 200
    assert call.status == "ERROR" and call.attributes["error.type"] == "RemoteProtocolError"
    (request,) = [s for s in receiver.spans if s.name == "wire.request"]
    assert request.status == "ERROR" and request.attributes["error.type"] == "RemoteProtocolError"
    records = [json.loads(line) for line in lines if line.strip()]
    (told,) = [r for r in records if r.get("event") == "wire.request"]
    assert told["level"] == "warning" and told["error"] == "RemoteProtocolError"
    assert told["status"] == 200
    (cut,) = [r for r in records if r.get("event") == "wire.upstream_cut"]
    assert cut["trace_id"] == told["trace_id"] == request.trace_id  # one trace to look at
