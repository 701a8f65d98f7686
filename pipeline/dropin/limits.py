"""The proxy's default bounds on what a client can hold, importable without the proxy extra
(the command line names them in its help)."""

from __future__ import annotations

__all__ = [
    "BODY_TIMEOUT",
    "EVENT_LOOPS",
    "HEADER_TIMEOUT",
    "HTTP_PARSERS",
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_HEAD_BYTES",
    "MAX_MESSAGES",
    "MAX_UPSTREAM_CONNECTIONS",
    "UPSTREAM_CLIENTS",
    "UPSTREAM_TIMEOUT",
]

MAX_BODY_BYTES = 32 * 1024 * 1024
"""The largest request body the proxy reads (the API's own limit); a larger one is a 413."""

MAX_ANSWER_BYTES = 32 * 1024 * 1024
"""The largest JSON answer the proxy reads whole for its usage (a Messages answer is far
smaller: 128K output tokens come to a few MB); a larger one is passed on as it comes, its usage
not read (logged ``wire.answer_too_large``)."""

MAX_MESSAGES = 100_000
"""The most messages a request may hold (the API's own limit); one with more is a 400 before
any conversation holds it."""

UPSTREAM_TIMEOUT = 600.0
"""Seconds an upstream call may take to answer (its response headers; for a JSON answer, the
whole generation) before the client is answered 504 ``timeout_error``."""

MAX_UPSTREAM_CONNECTIONS = 1_000
"""How many upstream calls the proxy runs at once by default."""

MAX_HEAD_BYTES = 16 * 1024
"""The largest request head (request line and headers) the proxy reads; a larger one is
answered 400 and its connection closed (``python -m pipeline proxy``; on ``--http h11``
uvicorn's own bound, on a head not yet ended)."""

BODY_TIMEOUT = 120.0
"""Seconds a client has to send a request's whole body, from the end of its head: then it is
answered 408 and its connection closed (a body sent a few bytes at a time must not hold a
connection forever). 32 MiB, the largest body, in that time: ~270 KB/s."""

HEADER_TIMEOUT = 30.0
"""Seconds a client has to send a request head, from its connection's start or the end of
the last response on it (``python -m pipeline proxy``)."""

HTTP_PARSERS = ("auto", "httptools", "h11")
"""The HTTP/1.1 parsers the proxy serves on (``--http``): ``auto`` is ``httptools`` where it
can be imported, else ``h11``."""

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""The event loops the proxy serves on (``--loop``): ``auto`` is ``uvloop`` where it can be
imported, else asyncio's own."""

UPSTREAM_CLIENTS = ("auto", "httptools", "aiohttp", "httpx2")
"""The HTTP clients the proxy's upstream calls may go out with (``--upstream-client``):
``httptools`` (asyncio's connections, answers read by llhttp) or ``aiohttp`` (each on asyncio;
``httpx2`` on another event loop), ``httpx2``, or ``auto``: the first of httptools and aiohttp
that can be imported, where no proxy is named by the environment (neither would honour it as
``httpx2`` does), else ``httpx2``."""
