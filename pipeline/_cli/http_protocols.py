"""The HTTP/1.1 protocols ``proxy`` serves on: uvicorn's own, with bounds on a request.

- **A deadline for each request head.** uvicorn times out an idle keep-alive connection but
  not a request head that never ends (a client that sends ``POST /v1/messages HTTP/1.1`` and
  a header, then nothing): such a connection would hold a descriptor for as long as the
  client likes. :func:`head_timed` is one of uvicorn's own HTTP/1.1 protocols with one timer
  more: from a connection's start, and from the end of each response, a request head must
  arrive within the deadline, else the connection is closed.
- **A bound on each request head.** A head of more than :data:`MAX_HEAD_BYTES` is answered
  400 and its connection closed. On ``h11`` that is uvicorn's own bound, on a head not yet
  ended: one that arrives whole in one read (at most 256 KiB) is read.
- **The faster parser when it is installed.** uvicorn's protocol on ``httptools`` (llhttp,
  in C) costs a request ~0.6 ms less CPU than the one on ``h11`` (pure Python) under 16
  conversations at once; ``h11`` serves where ``httptools`` cannot be imported, or when asked
  for (``--http h11``). uvicorn's ``httptools`` protocol bounds less than its ``h11`` one, so
  the subclass here adds: bytes received with no progress (no head ended, no body byte, no
  chunk begun) are bounded like a head -- llhttp keeps a header's value, a trailer's too, to
  itself until its line ends; at most 16 requests wait behind the one being answered (llhttp
  parses a whole read: 256 KiB of small requests were ~14,000 held at once); a request that
  asks to upgrade (curl's ``--http2`` on ``http://``) has its connection handed to the
  ``h11`` protocol from its first byte, which serves it as a plain request (llhttp would read
  what follows its head as the other protocol's bytes, its body lost), or is refused where
  that byte is not known or an answer is under way; the target is split as ``h11`` splits it
  (llhttp cuts a fragment off, and an absolute-form target's scheme and host); and a 400 for
  a later request waits for the answers under way (it would take their place), a waiting
  request whose body broke never served.
"""

from __future__ import annotations

import functools
import logging
from typing import Any
from urllib.parse import unquote

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.dropin.limits import HEADER_TIMEOUT, HTTP_PARSERS, MAX_HEAD_BYTES

__all__ = ["head_timed", "http_parser"]


class _HeadDeadline:
    """What both protocols add: from a connection's start and from the end of each response,
    a timer; when it fires with no request under way and no head ended (:meth:`_idle`), the
    connection is closed. Mixed in before uvicorn's protocol class."""

    head_timeout: float = HEADER_TIMEOUT
    _head_timer: Any = None
    transport: Any
    loop: Any
    cycle: Any

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _idle(self) -> bool:
        """No request head has ended since the timer was armed (the parser's own state)."""
        return True

    def _head_late(self) -> None:
        self._head_timer = None
        in_request = self.cycle is not None and not self.cycle.response_complete
        if self._idle() and not in_request and not self.transport.is_closing():
            self.transport.close()  # no request head in time: nothing is answered


class _HeadTimedH11(_HeadDeadline, H11Protocol):
    def _idle(self) -> bool:
        return self.conn.their_state is h11.IDLE


class _Refused(Exception):
    """Raised in a parser callback: ``httptools`` turns it into its parse error (a 400)."""


_QUIET = logging.getLogger("sluicegate.serving.handed_over")
_QUIET.disabled = True

_MOST_PIPELINED = 16
"""Requests a connection may send ahead of the answer it waits for (``httptools`` parses a
whole read at once: 256 KiB of small requests were ~14,000 held at once)."""


@functools.cache
def _tools_protocol() -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _HeadTimedTools(_HeadDeadline, HttpToolsProtocol):
        _stalled = 0
        """Bytes received since the last sign of progress: a head's end, body bytes, a
        chunk's start. llhttp keeps a header's value (a trailer's too) to itself until its
        line ends, so the callbacks alone cannot bound it; counted before each read is
        parsed and reset while it is, so a read's last bytes may go uncounted (one read)."""
        _head_parsed = 0
        """What the parser has handed over of this message's head and trailers: the URL,
        each header and its separators."""
        _reading_body = False
        """Between a request's head and its end."""
        _refusal: str | None = None
        """A 400 held back until the answers under way have gone (it would take their
        place on the connection)."""
        _in_message = False
        """Between a message's first byte and its end."""
        _read_fresh = False
        """The read being parsed began with no message under way."""
        _begun = 0
        """Messages begun in the read being parsed."""
        _raw: list[bytes] | None = None
        """The reads since the message being received began, while its head lasts, when it
        began a read (else None): what an upgrade's request is served again from."""
        _to_h11 = False
        """The request being received asks to upgrade: the connection goes on in h11."""
        _handed_over = False
        _before_newest: Any = None
        """The newest request's cycle before the one being received (uvicorn keeps only the
        newest): the newest again if that one is dropped."""

        def data_received(self, data: bytes) -> None:
            self._stalled += len(data)
            self._read_fresh, self._begun = not self._in_message, 0
            if self._read_fresh:
                self._raw = [data]
            elif self._raw is not None:
                self._raw.append(data)
            super().data_received(data)
            if self._handed_over:
                return
            if self._stalled > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.send_400_response("Invalid HTTP request received.")

        def send_400_response(self, msg: str) -> None:
            if self._to_h11:
                self._hand_over()
                return
            if self._reading_body and self.pipeline:
                # the newest request's body broke while it waited its turn: never served
                self.pipeline.popleft()
                self.cycle, self._reading_body = self._before_newest, False
            # a later request's refusal waits for the answers under way (it would take their
            # place on the connection); a body broken off while its own request is the one
            # being answered ends it at once
            if self._answering() and not self._reading_body:
                self._refusal = msg  # after the answers under way, then the connection ends
                self.flow.pause_reading()
                return
            super().send_400_response(msg)

        def _hand_over(self) -> None:
            """The connection, from the upgrading request's first byte on, to the h11
            protocol, which serves an upgrade it cannot make as a plain request (curl's
            ``--http2`` on an ``http://`` URL asks for ``h2c``); llhttp would read what
            follows the head as the other protocol's bytes."""
            assert self._raw is not None
            self._handed_over = True
            self._disarm()
            self._unset_keepalive_if_required()
            self.connections.discard(self)
            h11_protocol = head_timed(self.head_timeout, "h11")(
                config=self.config, server_state=self.server_state, app_state=self.app_state
            )
            h11_protocol.connection_made(self.transport)
            self.transport.set_protocol(h11_protocol)
            h11_protocol.data_received(b"".join(self._raw))

        def on_response_complete(self) -> None:
            super().on_response_complete()
            refusal = self._refusal
            if refusal is not None and not self._answering() and not self.transport.is_closing():
                super().send_400_response(refusal)

        def on_message_begin(self) -> None:
            self._head_parsed = 0
            self._in_message = True
            self._begun += 1
            if not (self._read_fresh and self._begun == 1):
                self._raw = None  # it began inside a read: where, llhttp does not say
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._parsed(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._parsed(len(name) + len(value) + 4)  # ": " and the line's end
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._stalled = 0
            if self._refusal is not None:
                raise _Refused  # nothing read after a refusal is served
            # llhttp would read what follows an upgrade's head as another protocol's bytes
            # (the body never reaching the app, the next request never answered): served by
            # h11 from its first byte, where nothing is being answered and that byte is
            # known; else refused
            if self.parser.should_upgrade():
                self._to_h11 = self._raw is not None and not self._answering()
                if self._to_h11:
                    self.logger = _QUIET  # uvicorn would log the stop as an invalid request
                raise _Refused
            self._raw = None
            if self._answering() and len(self.pipeline) >= _MOST_PIPELINED:
                raise _Refused
            self._before_newest = self.cycle
            self._reading_body = True
            super().on_headers_complete()
            # the target as the client wrote it, split as uvicorn's h11 protocol splits it:
            # llhttp's reading cuts a fragment off (not HTTP, but sent: it would not reach the
            # upstream) and an absolute-form target's scheme and host (which the app refuses)
            raw_path, _, query = self.url.partition(b"?")
            self.scope["raw_path"] = self.root_path.encode("ascii") + raw_path
            self.scope["path"] = self.root_path + unquote(raw_path.decode("ascii"))
            self.scope["query_string"] = query

        def on_body(self, body: bytes) -> None:
            self._stalled = 0
            super().on_body(body)

        def on_chunk_header(self) -> None:
            self._stalled = 0

        def on_message_complete(self) -> None:
            self._reading_body = self._in_message = False
            super().on_message_complete()

        def _answering(self) -> bool:
            """A request is being answered on this connection, or waits to be."""
            under_way = self.cycle is not None and not self.cycle.response_complete
            return under_way or bool(self.pipeline)

        def _parsed(self, size: int) -> None:
            self._head_parsed += size
            if self._head_parsed > MAX_HEAD_BYTES:
                raise _Refused

    return _HeadTimedTools


def http_parser(wanted: str = "auto") -> str:
    """The HTTP/1.1 parser ``wanted`` (one of :data:`HTTP_PARSERS`) names: ``auto`` is
    ``httptools`` if it can be imported, else ``h11``. ``ValueError`` for another name,
    ``ImportError`` for ``httptools`` when it cannot be imported."""
    if wanted not in HTTP_PARSERS:
        raise ValueError(f"the HTTP parser is one of {', '.join(HTTP_PARSERS)}, got {wanted!r}")
    if wanted == "h11":
        return "h11"
    try:
        import httptools  # noqa: F401
    except ImportError:
        if wanted == "httptools":
            raise
        return "h11"
    return "httptools"


def head_timed(seconds: float = HEADER_TIMEOUT, parser: str = "auto") -> type[Any]:
    """uvicorn's HTTP/1.1 protocol (``uvicorn.Config(http=...)``) on ``parser`` (see
    :func:`http_parser`) with a deadline of ``seconds`` for each request head and a bound of
    :data:`MAX_HEAD_BYTES` on it (see the module). uvicorn's ``h11`` protocol bounds a head
    itself: ``uvicorn.Config(h11_max_incomplete_event_size=MAX_HEAD_BYTES)``."""
    return _timed(seconds, http_parser(parser))


@functools.lru_cache(maxsize=16)
def _timed(seconds: float, parser: str) -> type[Any]:
    # one class per deadline and parser: each connection handed to h11 would make another
    base = _tools_protocol() if parser == "httptools" else _HeadTimedH11
    return type(f"HeadTimed{base.__name__}", (base,), {"head_timeout": seconds})
