"""A client's own loop, as an SDK user writes it, for the wrap and proxy tests: its history
sent whole every call, its tools' outputs as they came."""

from __future__ import annotations

import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import uvicorn

from pipeline import Pipeline
from pipeline._cli.http_protocols import head_timed
from pipeline.dropin.proxy import build_app
from pipeline.testing import Reply
from tests.cli_support import clean_env

TAG = "<persisted-output>"


def script(body: dict[str, Any]) -> Reply:
    """Six parallel calls per turn for ever (the client decides when to stop); ids name the
    conversation (its first words), so a test can tell conversations apart."""
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    first = str(body["messages"][0]["content"])[:8].replace(" ", "_")
    ids = [f"toolu_{first}_{turn:02d}_{i}" for i in range(6)]
    return Reply(
        [{"type": "tool_use", "id": t, "name": "get_log", "input": {}} for t in ids],
        stop_reason="tool_use",
    )


def results(content: list[Any]) -> dict[str, Any]:
    """The user message answering every tool_use of ``content`` with 45,000 chars."""
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": f"[{b.id}]" + "x" * 45_000}
            for b in content
            if b.type == "tool_use"
        ],
    }


async def client_loop(
    client: anthropic.AsyncAnthropic,
    prompt: str,
    calls: int,
    *,
    stream: bool = False,
    beta: bool = False,
) -> None:
    """The user's loop, unchanged: ``calls`` calls, each answered with the tools' outputs."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(calls):
        if stream:
            async with client.messages.stream(
                model="m",
                max_tokens=10,
                messages=messages,  # type: ignore[arg-type]
            ) as s:
                response = await s.get_final_message()
        else:
            create = client.beta.messages.create if beta else client.messages.create
            response = await create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]
        blocks = [b.model_dump(exclude_none=True) for b in response.content]
        messages.append({"role": "assistant", "content": blocks})
        messages.append(results(response.content))


def sync_client_loop(client: anthropic.Anthropic, prompt: str, calls: int) -> None:
    """:func:`client_loop` with the synchronous client."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(calls):
        response = client.messages.create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]
        blocks = [b.model_dump(exclude_none=True) for b in response.content]
        messages.append({"role": "assistant", "content": blocks})
        messages.append(results(response.content))


def conversation_dirs(root: Path) -> list[Path]:
    """Every conversation directory a drop-in made under ``root``:
    ``<root>/<tenant>/<conversation>``."""
    return sorted(d for t in root.iterdir() if t.is_dir() for d in t.iterdir() if d.is_dir())


def only(paths: list[Path]) -> Path:
    """The one path of ``paths`` (an assertion error naming them otherwise)."""
    assert len(paths) == 1, paths
    return paths[0]


def portable(texts: list[str], root: Path) -> list[str]:
    """``texts`` with the store's root and the tenant's name (a digest under the store's own
    secret) written alike, so two stores' requests compare."""
    return [re.sub(r"t-[0-9a-f]{20}", "TENANT", t.replace(str(root), "ROOT")) for t in texts]


def visible(body: dict[str, Any]) -> int:
    """Characters of tool output in a request's last message."""
    last = body["messages"][-1]["content"]
    return sum(len(b["content"]) for b in last) if isinstance(last, list) else 0


@contextmanager
def proxy(
    upstream: str,
    root: Path,
    pipeline: Callable[[], Pipeline],
    *,
    around: Callable[[Any], Any] | None = None,
    **options: Any,
) -> Iterator[str]:
    """The proxy served on a random port for the ``with`` block; yields its base URL.
    ``options``: more arguments of ``build_app`` (``storage``, session context); ``around``:
    an ASGI app wrapping the proxy's (one that records what clients sent, say)."""
    app = build_app(pipeline=pipeline, root=root, upstream=upstream, **options)
    if around is not None:
        app = around(app)
    # on the protocol the command serves on (its parser, its bounds on a request head)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", http=head_timed())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True  # graceful: requests in flight finish
        thread.join(timeout=20)


def free_port() -> int:
    """A free port for a child process to listen on, below the range the system hands out
    for port 0 and outgoing connections: no other test's server or client takes it before the
    child binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    for port in random.sample(range(20_000, max(20_001, min(low, 32_768))), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def process_running(*parts: str) -> int | None:
    """The process whose command line holds all of ``parts`` (Linux: ``/proc``; None where
    none does, or there is no ``/proc``)."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if all(part in cmdline for part in parts):
            return int(entry.name)
    return None


@contextmanager
def proxy_process(
    upstream: str,
    store: Path,
    *extra: str,
    preexec_fn: Callable[[], None] | None = None,
    **env: str,
) -> Iterator[tuple[str, list[str], list[int]]]:
    """The proxy command on a port of its choosing; yields its URL and the lines of its stderr
    (read as they come, so a chatty proxy never blocks on a full pipe; all of them once it
    has stopped: SIGINT, everything flushed) and, then, its exit code."""
    command = [sys.executable, "-m", "pipeline", "proxy", "--port", "0", "--store", str(store)]
    proc = subprocess.Popen(
        [*command, "--upstream", upstream, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(**env),
        preexec_fn=preexec_fn,
    )
    lines: list[str] = []
    code: list[int] = []
    listening = threading.Event()
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            lines.append(line)
            if "proxy on" in line or "proxy.listening" in line:
                listening.set()
        listening.set()  # it ended: the caller finds no URL

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        listening.wait(60)
        found = next(
            (m for line in lines if (m := re.search(r"(http://127\.0\.0\.1:\d+)", line))), None
        )
        if found is None:
            raise AssertionError("".join(lines))
        yield found.group(1), lines, code
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=10)
        code.append(proc.returncode)


def edited(msgs: list[Any], edit: str, message: Any, seen: list[list[Any]]) -> list[Any]:
    """``msgs`` after one step of a client's conversation, for tests of the body reader and
    writer: ``append`` (``append2``: twice) ``message``; ``edit`` (the middle one replaced,
    the last kept), ``replace`` (the middle one), ``equal_copy`` (the last as another, equal
    object); ``drop_last``; ``fork`` (an earlier request of ``seen``, then ``message``);
    ``empty``; anything else leaves it as it is."""
    if edit == "append":
        return [*msgs, message]
    if edit == "append2":
        return [*msgs, message, message]
    if edit == "edit" and msgs:
        out = [*msgs[:-1], message, *msgs[-1:]][-len(msgs) :]
        out[len(out) // 2] = message
        return out
    if edit == "replace" and msgs:
        out = list(msgs)
        out[len(out) // 2] = message
        return out
    if edit == "equal_copy" and msgs:
        return [*msgs[:-1], dict(msgs[-1])]
    if edit == "drop_last":
        return msgs[:-1]
    if edit == "fork":
        return [*seen[len(seen) // 2], message]
    if edit == "empty":
        return []
    return msgs


def stepped(
    start: list[Any], steps: list[Any], fields_edit: str
) -> Iterator[tuple[list[Any], dict[str, Any], list[Any]]]:
    """A client's conversation step by step: each step is (edit, message, new fields, *rest);
    yields the messages after it (:func:`edited`), the body's other fields (``{"model": "m"}``
    until a ``fields_edit`` step gives new ones) and the step's rest."""
    msgs, extra = list(start), {"model": "m"}
    seen: list[list[Any]] = [list(msgs)]
    for edit, message, new_fields, *rest in steps:
        msgs = edited(msgs, edit, message, seen)
        if edit == fields_edit:
            extra = new_fields
        seen.append(list(msgs))
        yield msgs, extra, rest


class RawUpstream:
    """An upstream on a plain socket of 127.0.0.1 that answers each connection with
    :meth:`answer` (raw bytes, whatever HTTP they make or break); close ``sock`` to stop it.
    ``threaded``: each connection answered in a thread of its own (else one after another)."""

    threaded = False

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.threaded:
                threading.Thread(target=self._answered, args=(conn,), daemon=True).start()
            else:
                self._answered(conn)

    def _answered(self, conn: socket.socket) -> None:
        with conn:
            self.answer(conn)

    def answer(self, conn: socket.socket) -> None:
        """Read the request and answer it on ``conn`` (closed afterwards)."""
        raise NotImplementedError


class ScriptedUpstream(RawUpstream):
    """Each connection in a thread of its own, each request on it answered by
    ``script(conn, request, n)`` (``n`` counting from 1 on each connection); keeps every
    request's raw bytes (``requests``) and counts connections (``connections``)."""

    threaded = True

    def __init__(self, script: Callable[[socket.socket, bytes, int], None]) -> None:
        self.script, self.connections = script, 0
        self.requests: list[bytes] = []
        self._counting = threading.Lock()
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        with self._counting:
            self.connections += 1
        n = 0
        while True:
            try:
                request = read_request(conn)
            except OSError:
                return
            if not request:
                return
            n += 1
            self.requests.append(request)
            try:
                self.script(conn, request, n)
            except OSError:
                return


def read_request(conn: socket.socket) -> bytes:
    """The whole of one request read from ``conn`` (its head, then as many bytes as its
    ``content-length`` says): a socket closed with bytes left unread resets the connection,
    which the peer would see as another error than the one an answer means."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    found = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    length = int(found.group(1)) if found else 0
    while len(body) < length:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class CutUpstream(RawUpstream):
    """An upstream that answers 200, starts its body and closes in the middle of it: an
    event stream cut in a chunk, or (``json=True``) a JSON body short of its length."""

    def __init__(self, *, json: bool = False) -> None:
        self.json = json
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        read_request(conn)
        if self.json:
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b'content-length: 100\r\n\r\n{"id": "msg_cut", "ty'  # 100 promised
            )
            return
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            b'40\r\nevent: message_start\r\ndata: {"type": "mess'  # 64 promised
        )


class StalledStream(RawUpstream):
    """An upstream that answers 200, sends the first event of a stream and then waits until
    ``release`` is set (a model still writing), then closes."""

    threaded = True

    def __init__(self) -> None:
        self.release = threading.Event()
        super().__init__()

    def answer(self, conn: socket.socket) -> None:
        read_request(conn)
        event = b'event: ping\ndata: {"type": "ping"}\n\n'
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(event), event)
        )
        self.release.wait(30)


class OffTheLoop:
    """Tells whether a blocking step ran off the event loop: the step calls :meth:`wait`, which
    waits for :meth:`free`, a task of the loop -- run on the loop, the step would wait for
    itself, and fails after ``timeout`` seconds. :meth:`free` gives up once the step has not
    begun in twice that (the test's own assertions say why)."""

    def __init__(self, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.began, self.freed = threading.Event(), threading.Event()

    def wait(self, what: str) -> None:
        self.began.set()
        assert self.freed.wait(self.timeout), f"{what} on the event loop"

    async def free(self) -> None:
        import anyio

        with anyio.move_on_after(2 * self.timeout):
            while not self.began.is_set():
                await anyio.sleep(0.01)
        self.freed.set()
