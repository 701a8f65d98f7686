"""A Messages event stream read as it passes, for the response's id, model and usage (what the
proxy and the wrapped client learn from a streamed response without holding it back)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.dropin.adapter import Call, WireSession
    from pipeline.dropin.wire_request import WireRequest

__all__ = ["MAX_EVENT_LINE", "EventStreamUsage"]

MAX_EVENT_LINE = 1 << 20
"""How much of a line that has not ended is held for the next chunk (bytes): a line whose held
start passes this is not read, so a stream without line ends holds no more than this and the
current chunk (a line that comes whole within one chunk is read whatever its length; the lines
read, ``message_start`` and ``message_delta``, are a few hundred bytes). Lines end at ``\n``
(``\r\n`` too), as the Messages API's do."""


class EventStreamUsage:
    """Reads a Messages event stream as it passes, for the response's id, model and usage
    (``message_start``, then ``message_delta``'s running totals), and gives them to the
    session at :meth:`close` (or :meth:`aclose`); the bytes are not changed, held back or
    buffered beyond the current line. ``final`` turns True once ``message_delta`` has been
    read: the usage is complete from there on. ``call``: the prepared request the response
    answers (default: the session's last); ``request``: the
    :class:`~pipeline.dropin.wire_request.WireRequest` to tell what the response said of itself."""

    def __init__(
        self,
        session: WireSession,
        call: Call | None = None,
        request: WireRequest | None = None,
        *,
        defer: bool = False,
    ) -> None:
        self.session = session
        self.defer = defer
        """Passed to :meth:`~pipeline.dropin.adapter.WireSession.observe_async`."""
        self.call = call
        self.request = request
        self._parts: list[bytes] = []
        """The current line's bytes so far (a line may come in many chunks)."""
        self._held = 0
        self._overlong = False
        self.message: dict[str, Any] = {}
        self.usage: dict[str, Any] = {}
        self.context_management: Any = None
        self.final = False
        self.done = False

    def feed(self, chunk: bytes) -> None:
        """The next bytes of the stream."""
        if b"\n" not in chunk:
            self._hold(chunk)
            return
        lines = chunk.split(b"\n")
        if self._parts or self._overlong:  # the line the last chunks began
            lines[0] = b"" if self._overlong else b"".join([*self._parts, lines[0]])
            self._parts, self._held, self._overlong = [], 0, False
        rest = lines.pop()
        for line in lines:
            # only these two events say anything of the response: the deltas of its content
            # (most of a stream) are not parsed
            if line.startswith(b"data:") and (
                b'"message_delta"' in line or b'"message_start"' in line
            ):
                self._event(line[5:].strip())
        self._hold(rest)

    def _hold(self, piece: bytes) -> None:
        """Keep the start of a line that has not ended, up to :data:`MAX_EVENT_LINE`."""
        if self._overlong or not piece:
            return
        self._held += len(piece)
        if self._held > MAX_EVENT_LINE:
            self._parts, self._held, self._overlong = [], 0, True
        else:
            self._parts.append(piece)

    def _event(self, data: bytes) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        if event.get("type") == "message_start" and isinstance(event.get("message"), dict):
            self.message = event["message"]
            if isinstance(self.message.get("usage"), dict):
                self.usage = dict(self.message["usage"])
        elif event.get("type") == "message_delta" and isinstance(event.get("usage"), dict):
            self.usage.update({k: v for k, v in event["usage"].items() if v is not None})
            delta = event.get("delta")
            edits = event.get("context_management") or (
                delta.get("context_management") if isinstance(delta, dict) else None
            )
            if edits is not None:
                self.context_management = edits
            self.final = True

    def _take(self) -> tuple[str, dict[str, Any], str] | None:
        """What the session observes (once): id, usage and model; None without them."""
        if self.done:
            return None
        self.done = True
        rid, model = self.message.get("id"), self.message.get("model")
        if self.request is not None:
            self.request.observed(
                response_id=rid if isinstance(rid, str) else None,
                model=model if isinstance(model, str) else None,
                usage=self.usage or None,
                context_management=self.context_management
                or self.message.get("context_management"),
            )
        if isinstance(rid, str) and self.usage:
            return rid, self.usage, str(model)
        return None

    def close(self) -> None:
        """The stream has gone by: the session observes the response (once)."""
        taken = self._take()
        if taken is not None:
            self.session.observe(*taken, call=self.call)  # (usage it refuses: recorded without)

    async def aclose(self) -> None:
        """:meth:`close`, the session's writes in a worker thread."""
        taken = self._take()
        if taken is not None:
            await self.session.observe_async(*taken, call=self.call, defer=self.defer)
