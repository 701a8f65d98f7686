"""SDK clients for tests, closed after each test.

An ``AsyncAnthropic`` client left to the garbage collector schedules the close of its pooled
connections in whatever event loop is running when it is collected: in a later test's loop,
with connections that belong to an earlier, closed one. That later test then fails with
"Event loop is closed" from a callback it never made. Tests make their async clients with
:func:`sdk_client` (in-process; a child process's client ends with it), and the ``conftest``
fixture closes them all when the test ends.
"""

from __future__ import annotations

from typing import Any

import anthropic
import anyio

_OPEN: list[anthropic.AsyncAnthropic] = []


def sdk_client(base_url: str, **settings: Any) -> anthropic.AsyncAnthropic:
    """A real SDK client for ``base_url`` (no retries unless asked), closed after the test."""
    settings.setdefault("api_key", "k")
    settings.setdefault("max_retries", 0)
    client = anthropic.AsyncAnthropic(base_url=base_url, **settings)
    _OPEN.append(client)
    return client


def close_sdk_clients() -> None:
    """Close every client :func:`sdk_client` made, outside any event loop.

    A client still holding a connection of a closed loop makes this raise (after the others
    are closed), so a test that leaves one open fails where it did so, not in whichever test
    collects it.
    """
    clients, _OPEN[:] = list(_OPEN), []
    errors: list[Exception] = []
    for client in clients:
        if not client.is_closed():
            try:
                anyio.run(client.close)
            except Exception as exc:  # every client closed; the first error raised after
                errors.append(exc)
    if errors:
        raise errors[0]
