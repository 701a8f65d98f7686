"""What the Claude Code proxy tests need beside :mod:`tests.wire_support`: the requests a client
sent to the proxy, as it sent them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def recording(sent: list[dict[str, Any]]) -> Callable[[ASGIApp], ASGIApp]:
    """An ASGI wrapper (``proxy(..., around=recording(sent))``) that appends the body of each
    ``/v1/messages`` request to ``sent`` before the app sees it (parsed; a body that is not JSON
    is left out)."""

    def around(app: ASGIApp) -> ASGIApp:
        async def recorded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/messages":
                await app(scope, receive, send)
                return
            chunks: list[bytes] = []

            async def tap() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body"):
                        with contextlib.suppress(ValueError):
                            sent.append(json.loads(b"".join(chunks)))
                return message

            await app(scope, tap, send)

        return recorded

    return around
