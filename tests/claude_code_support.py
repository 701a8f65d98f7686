"""What the Claude Code proxy tests need beside :mod:`tests.wire_support`: a scripted API that
takes Claude Code's ``/v1/messages?beta=true``, and the requests a client sent to the proxy, as
it sent them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.testing import ScriptedMessagesServer


class BetaScriptedServer(ScriptedMessagesServer):
    """:class:`ScriptedMessagesServer` routing on the path without its query: Claude Code posts
    to ``/v1/messages?beta=true``, which the proxy forwards as it came."""

    def _reply(self, path: str, body: dict[str, Any]) -> Any:
        return super()._reply(path.partition("?")[0], body)


def recording(
    build_app: Callable[..., ASGIApp], sent: list[dict[str, Any]]
) -> Callable[..., ASGIApp]:
    """``build_app`` whose app first appends each ``/v1/messages`` body it receives to
    ``sent`` (parsed; a body that is not JSON is left out)."""

    def build(**options: Any) -> ASGIApp:
        app = build_app(**options)

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

    return build
