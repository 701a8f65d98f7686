"""A Messages API response, checked before the agent records or acts on it.

The SDK builds its response objects without validating them, so a 200 with HTML, an empty or
wrong-shaped body, ``null`` content or usage, a text block whose text is a number or a tool_use
without an id arrives as an object that fails somewhere later -- in the loop, or worse, in the
transcript, which its own loader then rejects. Every such response is refused here as an
:class:`~pipeline.agent.results.AgentAPIError` of kind ``bad_response``; nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

import anthropic
from pydantic import BaseModel

from pipeline.agent.results import AgentAPIError
from pipeline.messages import Block, Message, Usage, now_timestamp
from pipeline.wire.encoding import encodable

if TYPE_CHECKING:
    from anthropic.types import MessageParam

__all__ = ["call_messages", "message_from_response"]

_MAX_ID_CHARS = 256


def _bad(why: str, *, request: Any, status: int | None, request_id: str | None) -> AgentAPIError:
    return AgentAPIError(
        "bad_response",
        f"the API answered with a malformed message: {why}",
        status=status,
        request_id=request_id,
        request=request,
    )


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_block(i: int, block: Mapping[str, Any], ids: set[str], known: Set[str]) -> str | None:
    """Why content block ``i`` is malformed, or None."""
    btype = block.get("type")
    if not isinstance(btype, str):
        return f"content[{i}] has no string 'type'"
    if btype == "text" and not isinstance(block.get("text"), str):
        return f"content[{i}]: text block whose text is {_brief(block.get('text'))}"
    if btype == "thinking" and not isinstance(block.get("thinking"), str):
        return f"content[{i}]: thinking block without a string 'thinking'"
    if btype == "tool_use":
        tid = block.get("id")
        if not isinstance(tid, str) or not tid or len(tid) > _MAX_ID_CHARS:
            return f"content[{i}]: tool_use whose id is {_brief(tid)}"
        if encodable(tid) is not tid:  # two such ids could be one on the wire
            return f"content[{i}]: tool_use id {_brief(tid)} is not valid text"
        if not isinstance(block.get("name"), str):
            return f"content[{i}]: tool_use {tid!r} without a string 'name'"
        if not isinstance(block.get("input"), dict):  # the API requires an object
            return f"content[{i}]: tool_use {tid!r} whose input is {_brief(block.get('input'))}"
        if tid in ids:
            return f"content[{i}]: tool_use id {tid!r} repeated in one response"
        if tid in known:
            return f"content[{i}]: tool_use id {tid!r} already used earlier in the conversation"
        ids.add(tid)
    return None


def message_from_response(
    response: object,
    *,
    known_tool_ids: Set[str],
    known_response_ids: Set[str] = frozenset(),
    request: Any = None,
    status: int | None = None,
    request_id: str | None = None,
) -> Message:
    """The assistant record of a parsed API response; :class:`AgentAPIError` (``bad_response``)
    naming the first thing wrong when the response is not a well-formed message.

    ``known_tool_ids``: the tool_use ids of the conversation so far (the API rejects a request
    that uses one twice, so a response that reuses one could never be answered);
    ``known_response_ids``: its responses' ids (a response reusing one would be taken for a
    part of that one, the two sent as one message).
    """

    def bad(why: str) -> AgentAPIError:
        return _bad(why, request=request, status=status, request_id=request_id)

    if not isinstance(response, anthropic.types.Message):
        return_type = type(response).__name__
        raise bad(f"expected a message object, got {return_type}")
    message_id, model, stop_reason = response.id, response.model, response.stop_reason
    if not isinstance(message_id, str) or not message_id:
        raise bad(f"its id is {_brief(message_id)}")
    if message_id in known_response_ids:
        raise bad(f"its id {_brief(message_id)} is an earlier response's")
    if not isinstance(model, str):
        raise bad(f"its model is {_brief(model)}")
    if stop_reason is not None and not isinstance(stop_reason, str):
        raise bad(f"its stop_reason is {_brief(stop_reason)}")
    content: Any = response.content
    if not isinstance(content, list):
        raise bad(f"its content is {type(content).__name__}, not a list")
    blocks: list[Block] = []
    ids: set[str] = set()
    for i, item in enumerate(content):
        if not isinstance(item, BaseModel):
            raise bad(f"content[{i}] is {type(item).__name__}, not a content block")
        try:
            block = item.model_dump(mode="json", exclude_none=True, warnings=False)
        except Exception as exc:  # a block the SDK built but cannot dump
            raise bad(f"content[{i}] cannot be read ({type(exc).__name__})") from None
        why = _check_block(i, block, ids, known_tool_ids)
        if why is not None:
            raise bad(why)
        blocks.append(block)
    usage_model: Any = response.usage
    if not isinstance(usage_model, BaseModel):
        raise bad("it has no usage")
    try:
        usage = Usage.from_mapping(usage_model.model_dump(warnings=False))
    except (ValueError, TypeError) as exc:
        raise bad(f"its usage is invalid ({exc})") from None
    return Message.assistant(
        blocks,
        message_id=message_id,
        usage=usage,
        model=model,
        stop_reason=stop_reason,
        timestamp=now_timestamp(),  # the idle-gap triggers read these
    )


async def call_messages(
    client: anthropic.AsyncAnthropic,
    request: Sequence[MessageParam],
    *,
    model: str,
    max_tokens: int,
    known_ids: Callable[[], tuple[Set[str], Set[str]]],
    **kwargs: Any,
) -> Message:
    """One Messages API call; the response checked and made a record, or AgentAPIError.
    ``known_ids`` (the conversation's tool_use ids and response ids) is asked once the response
    has arrived: a concurrent turn of the same conversation may have recorded more meanwhile."""
    try:
        raw = await client.messages.with_raw_response.create(
            model=encodable(model), max_tokens=max_tokens, messages=request, **kwargs
        )
    except anthropic.APIError as exc:
        raise AgentAPIError.from_sdk(exc) from exc
    except (ValueError, TypeError, UnicodeError) as exc:  # the client could not send it
        raise AgentAPIError(
            "bad_request",
            f"the request could not be sent ({type(exc).__name__})",
            status=None,
            request_id=None,
        ) from exc
    http = raw.http_response
    where: dict[str, Any] = {
        "request": http.request,
        "status": http.status_code,
        "request_id": http.headers.get("request-id"),
    }
    try:
        response = await raw.parse()
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        why = f"its body cannot be parsed ({type(exc).__name__})"
        raise AgentAPIError(
            "bad_response", f"the API answered with a malformed message: {why}", **where
        ) from None
    tool_ids, response_ids = known_ids()
    return message_from_response(
        response, known_tool_ids=tool_ids, known_response_ids=response_ids, **where
    )
