"""The proxy's default bounds on what a client can hold, importable without the proxy extra
(the command line names them in its help)."""

from __future__ import annotations

__all__ = ["HEADER_TIMEOUT", "MAX_BODY_BYTES", "MAX_UPSTREAM_CONNECTIONS", "UPSTREAM_TIMEOUT"]

MAX_BODY_BYTES = 32 * 1024 * 1024
"""The largest request body the proxy reads (the API's own limit); a larger one is a 413."""

UPSTREAM_TIMEOUT = 600.0
"""Seconds an upstream call may take to answer (its response headers; for a JSON answer, the
whole generation) before the client is answered 504 ``timeout_error``."""

MAX_UPSTREAM_CONNECTIONS = 1_000
"""How many upstream calls the proxy runs at once by default."""

HEADER_TIMEOUT = 30.0
"""Seconds a client has to send a request head, from its connection's start or the end of
the last response on it (``python -m pipeline proxy``)."""
