"""The conversation the model sees is its own: the real SDK over HTTP, through the proxy and
through ``wrap``, against the scripted Messages API.

1. conversations that open alike, with the same tool ids, never get each other's output;
2. another API key never gets, changes or snips a conversation, whatever it names;
3. text a harness appended to a tool result (Claude Code's ``<system-reminder>``) is never
   persisted with the output: it reaches the model as it came;
4. a fork (Claude Code's: the parent's messages, then its own way) sends its parent's bytes;
5. a conversation's first call is the conversation's (Claude Code marks a lone first message);
6. threads of one synchronous wrapped client that share an opening never hang.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from pipeline import Pipeline
from pipeline.dropin.wrap import wrap
from pipeline.testing import Reply, ScriptedMessagesServer, ScriptError
from stages import default_stages
from tests.cli_support import clean_env
from tests.wire_support import TAG, proxy

Client = Callable[..., Any]
"""``client(api_key, **headers)``: something with ``messages.create`` whose calls go through
the drop-in under test with that key and those headers."""


def text_reply(body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


class _Messages:
    def __init__(self, client: anthropic.Anthropic, headers: dict[str, str]) -> None:
        self.client, self.headers = client, headers

    def create(self, **params: Any) -> Any:
        return self.client.messages.create(**params, extra_headers=self.headers)


class PerRequest:
    """One wrapped client of a program that serves several keys: each request carries its
    key and headers (what the middleware sees of a request)."""

    def __init__(self, client: anthropic.Anthropic, headers: dict[str, str]) -> None:
        self.messages = _Messages(client, headers)


@contextlib.contextmanager
def drop_in(kind: str, root: Path) -> Iterator[tuple[ScriptedMessagesServer, Client]]:
    """The scripted API and a factory of clients through ``kind``: "proxy" (a client per key,
    as separate programs in front of one proxy) or "wrap" (one wrapped client, each request
    with its key), every client closed at the end."""
    made: list[anthropic.Anthropic] = []
    pipeline = lambda: Pipeline(default_stages())  # noqa: E731
    with ScriptedMessagesServer(text_reply) as server, contextlib.ExitStack() as stack:
        url = stack.enter_context(proxy(server.base_url, root, pipeline)) if kind == "proxy" else ""
        one = anthropic.Anthropic(
            base_url=server.base_url, api_key="sk-ant-program", max_retries=0, timeout=60
        )
        made.append(one)
        wrapped = wrap(one, root=root, pipeline=pipeline)

        def client(api_key: str, **headers: str) -> Any:
            if kind == "wrap":
                return PerRequest(wrapped, {"x-api-key": api_key, **headers})
            raw = anthropic.Anthropic(
                base_url=url, api_key=api_key, max_retries=0, timeout=60, default_headers=headers
            )
            made.append(raw)
            return raw

        try:
            yield server, client
        finally:
            for c in made:
                c.close()


def create(client: Any, messages: list[Any], system: Any = "bot") -> None:
    client.messages.create(model="m", max_tokens=10, system=system, messages=messages)


def calls(*tids: str, name: str = "Bash") -> dict[str, Any]:
    """The assistant message that calls tools ``tids``."""
    return {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": t, "name": name, "input": {}} for t in tids],
    }


def answers(*pairs: tuple[str, Any]) -> dict[str, Any]:
    """The user message answering calls: ``(tool_use_id, content)`` pairs."""
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": t, "content": c} for t, c in pairs],
    }


def build(output: str, tid: str = "toolu_01build") -> list[dict[str, Any]]:
    """The opening every client of a team uses: one build, its log."""
    return [{"role": "user", "content": "run the build"}, calls(tid), answers((tid, output))]


def results_of(body: dict[str, Any]) -> list[str]:
    return [
        str(b.get("content"))
        for m in body["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


def all_text(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file())


KINDS = pytest.mark.parametrize("kind", ["proxy", "wrap"])


# 1 -------------------------------------------------------------------------------------------
@KINDS
@pytest.mark.parametrize("named", [False, True])
def test_alike_conversations_never_get_each_others_output(
    tmp_path: Path, kind: str, named: bool
) -> None:
    headers = {"x-sluicegate-session": "team"} if named else {}
    with drop_in(kind, tmp_path) as (server, client):
        team = client("sk-ant-one", **headers)
        create(team, build("A-SECRET build log line\n" * 6_000))
        create(team, build("hello from B"))
        more = [{"role": "assistant", "content": "done?"}, {"role": "user", "content": "yes"}]
        create(team, [*build("hello from B"), *more])
        sent = server.requests
    assert results_of(sent[0])[0].startswith(TAG)
    for body in sent[1:]:
        assert results_of(body) == ["hello from B"]
        assert "A-SECRET" not in json.dumps(body)


# 2 -------------------------------------------------------------------------------------------
@KINDS
def test_another_key_never_gets_a_conversations_output(tmp_path: Path, kind: str) -> None:
    with drop_in(kind, tmp_path) as (server, client):
        b = client("sk-ant-B", **{"x-sluicegate-session": "team"})
        a = client("sk-ant-A", **{"x-sluicegate-session": "team"})
        create(b, build("B-SECRET private build log\n" * 6_000))
        create(a, build("hello from A"))
        sent = server.requests
    assert results_of(sent[0])[0].startswith(TAG)
    assert results_of(sent[1]) == ["hello from A"] and "B-SECRET" not in json.dumps(sent[1])
    tenants = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(tenants) == 2
    assert sum("B-SECRET" in all_text(d) for d in tenants) == 1
    assert "sk-ant" not in all_text(tmp_path)  # a credential is never written down


@KINDS
def test_another_key_cannot_snip_a_conversation(tmp_path: Path, kind: str) -> None:
    """B works through 15 rounds; A, under the same name, sends one long request shaped to
    make the proxy believe the conversation is near its window; B's next request is still
    whole."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "investigate the flaky tests"}]
    for i in range(15):
        t = f"toolu_B{i:02d}"
        history += [calls(t), answers((t, f"B line {i} " * 1200))]
    poison: list[dict[str, Any]] = [history[0]]  # the same opening: one name either way
    for _ in range(15):
        poison += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    poison[-1] = {"role": "user", "content": "x " * 320_000}
    with drop_in(kind, tmp_path) as (server, client):
        b = client("sk-ant-B", **{"x-sluicegate-session": "b-conv"})
        a = client("sk-ant-A", **{"x-sluicegate-session": "b-conv"})
        create(b, history)
        create(a, poison)
        more = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "continue"}]
        create(b, [*history, *more])
        sent = server.requests
    before, after = results_of(sent[0]), results_of(sent[2])
    assert len(sent[2]["messages"]) == len(history) + 2  # nothing snipped
    assert after == before


# 3 -------------------------------------------------------------------------------------------
REPORT = (
    "\n\n<system-reminder>\n<tools-used-before-summary>Bash</tools-used-before-summary>\n"
    "</system-reminder>\n\n<system-reminder>\n[SYSTEM NOTIFICATION - NOT USER INPUT]\n"
    "<task-notification>\n<status>completed</status>\n<result>Report: REPORT-MARKER-12345, "
    "all good.</result>\n</task-notification>\n</system-reminder>\n\n<system-reminder>\n"
    "<total_tokens>14976412 tokens left</total_tokens>\n</system-reminder>"
)


@KINDS
def test_harness_text_reaches_the_model_and_never_the_store(tmp_path: Path, kind: str) -> None:
    """Three parallel results of equal size, 240K together: the budget persists some; the last
    one carries a finished sub-agent's report, which must reach the model in this and every
    later request, and must not be in any persisted file."""
    tids = [f"toolu_p{i}" for i in range(3)]
    outputs = [f"log {i} " * 13_000 for i in range(3)]  # 78K each
    outputs[2] += REPORT
    history = [
        {"role": "user", "content": "check the three jobs"},
        calls(*tids),
        answers(*zip(tids, outputs, strict=True)),
    ]
    later = [
        *history,
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "go on"},
    ]
    with drop_in(kind, tmp_path) as (server, client):
        c = client("sk-ant-one")
        create(c, history)
        create(c, later)
        sent = server.requests
    for body in sent:
        last = results_of(body)[2]
        assert last.endswith(REPORT)  # verbatim, after the output or its replacement
        assert sum(r.startswith(TAG) for r in results_of(body)) >= 1
    assert results_of(sent[0]) == results_of(sent[1])
    files = [p for p in tmp_path.rglob("tool-results/*") if p.is_file()]
    assert files and not any("REPORT-MARKER" in p.read_text() for p in files)


@KINDS
def test_a_result_persisted_by_its_own_size_keeps_its_reminder(tmp_path: Path, kind: str) -> None:
    history = build("x" * 60_000 + REPORT)
    with drop_in(kind, tmp_path) as (server, client):
        create(client("sk-ant-one"), history)
        (sent,) = server.requests
    (content,) = results_of(sent)
    assert content.startswith(TAG) and content.endswith("</persisted-output>" + REPORT)
    (saved,) = [p for p in tmp_path.rglob("tool-results/*") if p.is_file()]
    assert saved.read_text() == "x" * 60_000


# 4 -------------------------------------------------------------------------------------------
def claude_code_system(subagent: bool) -> list[dict[str, Any]]:
    flag = " cc_is_subagent=true;" if subagent else ""
    return [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328.b98;{flag}"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ]


@KINDS
def test_a_fork_sends_its_parents_bytes(tmp_path: Path, kind: str) -> None:
    first = build("parent's build log\n" * 3_000)  # 57K: persisted by its own size
    history = [*first, calls("toolu_02"), answers(("toolu_02", "ok"))]
    launch = [
        {"type": "text", "text": "I'll fork this."},
        {"type": "tool_use", "id": "toolu_ag", "name": "Agent", "input": {"subagent_type": "fork"}},
    ]
    parent_next = [
        *history,
        {"role": "assistant", "content": launch},
        answers(("toolu_ag", "Async agent launched")),
    ]
    started = answers(("toolu_ag", "Fork started"))
    started["content"].append({"type": "text", "text": "Your directive: check the tests"})
    fork = [*history, {"role": "assistant", "content": launch[1:]}, started]
    with drop_in(kind, tmp_path) as (server, client):
        c = client("sk-ant-one")
        create(c, first, claude_code_system(False))  # its output new: persisted
        create(c, history, claude_code_system(False))
        create(c, fork, claude_code_system(True))
        create(c, parent_next, claude_code_system(False))
        sent = server.requests[1:]
    parent = sent[0]["messages"]
    assert results_of(server.requests[0])[0].startswith(TAG)
    assert parent[2]["content"][0]["content"].startswith(TAG)
    assert sent[1]["messages"][: len(parent)] == parent  # the fork: its parent's bytes
    assert sent[2]["messages"][: len(parent)] == parent
    assert len([p for p in tmp_path.rglob("tool-results/*") if p.is_file()]) == 1


# 5 -------------------------------------------------------------------------------------------
@KINDS
def test_the_first_call_is_the_conversations(tmp_path: Path, kind: str) -> None:
    marked = {"type": "text", "text": "first task", "cache_control": {"type": "ephemeral"}}
    first = [{"role": "user", "content": [marked]}]
    later = [
        {"role": "user", "content": [{"type": "text", "text": "first task"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and then?"},
    ]
    with drop_in(kind, tmp_path) as (_server, client):
        c = client("sk-ant-one")
        create(c, first, claude_code_system(False))
        create(c, later, claude_code_system(False))
    (log,) = tmp_path.rglob("decisions*.jsonl")  # one conversation, one ledger
    responses = [
        json.loads(line)["data"]
        for line in log.read_text().splitlines()
        if '"wire_session.response"' in line
    ]
    assert [r["index"] for r in responses] == [1, 3]  # both calls' responses


# 6 -------------------------------------------------------------------------------------------
def test_threads_of_a_sync_wrapped_client_never_hang(tmp_path: Path) -> None:
    done: list[int] = []
    failures: list[BaseException] = []

    def run(client: anthropic.Anthropic) -> None:
        import concurrent.futures

        def one(k: int) -> None:
            conv = build(f"part {k % 2}", tid=f"t{k % 2}")
            client.messages.create(model="m", max_tokens=10, system="bot", messages=conv)
            done.append(k)

        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(one, range(12)))
        except BaseException as exc:
            failures.append(exc)

    with ScriptedMessagesServer(text_reply) as server:
        for session_id in (None, "one-id"):
            raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
            client = wrap(
                raw,
                root=tmp_path,
                session_id=session_id,
                pipeline=lambda: Pipeline(default_stages()),
            )
            thread = threading.Thread(target=run, args=(client,), daemon=True)
            thread.start()
            thread.join(timeout=60)
            raw.close()
            assert not thread.is_alive(), f"hung (session_id={session_id})"
    assert not failures and len(done) == 24


# the command -----------------------------------------------------------------------------------
@pytest.mark.parametrize("single", [False, True])
def test_the_proxy_command_keeps_keys_apart_unless_told(tmp_path: Path, single: bool) -> None:
    """``python -m pipeline proxy`` as users run it: two keys, one opening; by default each key
    has its own tenant directory, with ``--single-tenant`` they share one conversation."""
    store = tmp_path / "store"
    extra = ["--single-tenant"] if single else []
    with ScriptedMessagesServer(text_reply) as upstream:
        command = [sys.executable, "-m", "pipeline", "proxy", "--port", "0", "--store", str(store)]
        proc = subprocess.Popen(
            [*command, "--upstream", upstream.base_url, *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        try:
            assert proc.stderr is not None
            banner = proc.stderr.readline()
            found = re.search(r"on (http://127\.0\.0\.1:\d+) ", banner)
            assert found, banner
            for key in ("sk-ant-A", "sk-ant-B"):
                raw = anthropic.Anthropic(base_url=found.group(1), api_key=key, max_retries=0)
                create(raw, build("log line\n" * 6_000))
                raw.close()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
        sent = upstream.requests
    assert all(results_of(b)[0].startswith(TAG) for b in sent)
    tenants = sorted(d.name for d in store.iterdir() if d.is_dir())
    if single:
        assert tenants == ["shared"] and len(list(store.rglob("tool-results/*"))) == 1
        assert sent[0]["messages"] == sent[1]["messages"]  # one conversation, one decision
    else:
        assert len(tenants) == 2 and all(re.fullmatch(r"t-[0-9a-f]{20}", t) for t in tenants)
        assert len(list(store.rglob("tool-results/*"))) == 2


def test_a_cookie_the_upstream_sets_never_goes_with_another_clients_request(
    tmp_path: Path,
) -> None:
    """The proxy's one upstream client keeps no cookies: a ``Set-Cookie`` answered to one key
    (a load balancer's, say) goes back to that client, never out with another's requests."""
    answered: list[int] = []

    def script(body: dict[str, Any]) -> Reply | ScriptError:
        answered.append(1)
        if len(answered) == 1:
            return ScriptError(429, "rate_limit_error", "slow down", {"set-cookie": "lb=A; Path=/"})
        return text_reply(body)

    with (
        ScriptedMessagesServer(script) as server,
        proxy(server.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        for key in ("sk-ant-A", "sk-ant-B"):
            raw = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
            with contextlib.suppress(anthropic.RateLimitError):
                create(raw, build("log"))
            raw.messages.count_tokens(model="m", messages=build("log"))  # passed through
            raw.close()
        sent = server.request_headers
    assert len(sent) == 2 and all("cookie" not in h for h in sent)


# hostile nesting -------------------------------------------------------------------------------
def test_deeply_nested_requests_get_a_clear_400_and_the_proxy_serves_on(tmp_path: Path) -> None:
    import httpx2

    def nested(depth: int) -> bytes:
        """A request whose one message nests ``depth`` blocks deep, as JSON text (too deep for
        a client to encode from objects)."""
        content = '[{"type":"text","text":"y","extra":' * depth + '"x"' + "}]" * depth
        message = '{"role":"user","content":' + content + "}"
        return ('{"model":"m","max_tokens":5,"messages":[' + message + "]}").encode()

    deep_metadata = {"user_id": "[" * 5_000 + "]" * 5_000}
    headers = {"x-api-key": "k", "content-type": "application/json"}
    with (
        ScriptedMessagesServer(text_reply) as server,
        proxy(server.base_url, tmp_path, lambda: Pipeline(default_stages())) as url,
    ):
        for depth in (900, 5_000):
            got = httpx2.post(f"{url}/v1/messages", content=nested(depth), headers=headers)
            assert got.status_code in (200, 400), (depth, got.status_code)
            if got.status_code == 400:
                assert "nested too deeply" in got.json()["error"]["message"]
        ok = {"model": "m", "max_tokens": 5, "metadata": deep_metadata, "messages": build("x")}
        assert httpx2.post(f"{url}/v1/messages", json=ok, headers=headers).status_code == 200
        fine = {"model": "m", "max_tokens": 5, "messages": build("still serving")}
        assert httpx2.post(f"{url}/v1/messages", json=fine, headers=headers).status_code == 200
        assert results_of(server.requests[-1]) == ["still serving"]
