"""Summaries for the compaction stages: a one-method protocol and an Anthropic implementation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import anyio

if TYPE_CHECKING:  # the SDK is heavy to import: only AnthropicSummarizer needs it, at run time
    import anthropic
    from anthropic.types import MessageParam


__all__ = [
    "DEFAULT_SUMMARY_PROMPT",
    "SUMMARY_TIMEOUT",
    "AnthropicSummarizer",
    "Summarizer",
    "SummaryError",
    "SummaryPromptTooLong",
    "SummaryTimeout",
    "ask_summary",
]

DEFAULT_SUMMARY_PROMPT = (
    "Summarise the conversation above so that the work can continue without it. Keep: the "
    "user's requests and constraints, decisions made and why, files and commands involved, "
    "errors met and how they were resolved, and what remains to be done. Be specific and "
    "concise; do not address the user. Reply with the summary only."
)


class SummaryError(RuntimeError):
    """The summariser could not produce a summary."""


class SummaryPromptTooLong(SummaryError):
    """The summary request itself exceeded the model's context: send less and retry."""


SUMMARY_TIMEOUT = 600.0
"""Seconds a stage waits for one summary by default (the anthropic SDK's own request
timeout): a summariser that never answers counts as a failed summary, not a turn that never
ends."""


async def ask_summary(
    summarizer: Summarizer, messages: Sequence[MessageParam], timeout: float = SUMMARY_TIMEOUT
) -> str:
    """``summarizer``'s summary of ``messages``, checked: :class:`SummaryError` when it is not
    text (a ``str`` subclass is taken as its plain text) or takes longer than ``timeout``
    seconds; what the summariser raises propagates (:class:`SummaryPromptTooLong` included)."""
    with anyio.move_on_after(timeout) as waited:
        text = await summarizer.summarize(messages)
    if waited.cancelled_caught:
        raise SummaryTimeout(f"no summary within {timeout:g} s")
    if not isinstance(text, str):
        raise SummaryError(f"summarizer returned {type(text).__name__}, not str")
    return str.__str__(text)  # a subclass's own __str__ is not the text


class SummaryTimeout(SummaryError):
    """The summariser gave no answer within the stage's ``summary_timeout``."""


@runtime_checkable
class Summarizer(Protocol):
    """Turns a span of conversation (wire form) into summary text."""

    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        """Return the summary; raise :class:`SummaryPromptTooLong` when the input is too big."""
        ...


def _with_instruction(messages: Sequence[MessageParam], prompt: str) -> list[MessageParam]:
    """The conversation followed by the instruction, keeping roles alternating."""
    out = list(messages)
    if out and out[-1]["role"] == "user":
        last = out[-1]
        content: Any = last["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        out[-1] = cast(
            "MessageParam", {"role": "user", "content": [*blocks, {"type": "text", "text": prompt}]}
        )
    else:
        out.append({"role": "user", "content": prompt})
    return out


class AnthropicSummarizer:
    """Summaries from a model over the Messages API (any ``AsyncAnthropic`` client)."""

    def __init__(
        self,
        client: anthropic.AsyncAnthropic,
        *,
        model: str,
        max_tokens: int = 8_000,
        prompt: str = DEFAULT_SUMMARY_PROMPT,
    ) -> None:
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.prompt = prompt

    async def summarize(self, messages: Sequence[MessageParam]) -> str:
        """One ``messages.create`` call; the text of the reply is the summary."""
        import anthropic

        try:
            reply = await self.client.messages.create(
                model=self.model,
                max_tokens=self.max_tokens,
                messages=_with_instruction(messages, self.prompt),
            )
        except anthropic.BadRequestError as exc:
            if "prompt is too long" in str(exc).lower():
                raise SummaryPromptTooLong(
                    f"summary request too long (request id {exc.request_id})"
                ) from exc
            raise SummaryError(f"summary request refused (request id {exc.request_id})") from exc
        except anthropic.APIError as exc:
            raise SummaryError(f"summary request failed: {type(exc).__name__}") from exc
        return "".join(b.text for b in reply.content if b.type == "text").strip()
