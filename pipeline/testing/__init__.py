"""Test doubles for code built on sluicegate, the way ``structlog.testing`` or
``httpx.MockTransport`` serve their users (and what sluicegate's own tests use):

- :class:`ScriptedMessagesServer`: a local stand-in for the Messages API (127.0.0.1, random
  port) that the real ``anthropic`` SDK talks to over HTTP; a *script* picks each reply
  (a :class:`Reply`, a :class:`ScriptError`, or a :class:`RawReply` sent byte for byte;
  :func:`compaction_reply` is a server-side compaction as the API answers one);
  :func:`messages_api`: that server for a ``with`` block unless ``ANTHROPIC_API_KEY`` is set
  (examples that run offline, and against the API given a key);
- :class:`MemoryStore`: a tool-result store in memory;
- :class:`SpanRecorder`: the spans a stage emits, in memory (needs the OpenTelemetry SDK);
- :class:`QuietLogger`: a logger that keeps its events and prints nothing;
- :func:`run_stage`: one stage run exactly as the pipeline runs it; :class:`RecordReads`:
  which old records a pass looked at (is a pass as cheap as its new part?);
- :func:`assert_same_messages`: two message lists compared field by field, content byte for
  byte (messages themselves compare by identity); :func:`without_cache_control`: a received
  request's messages without the breakpoints a client moves every call.
"""

from pipeline.testing.doubles import (
    MemoryStore,
    QuietLogger,
    RecordReads,
    SpanRecorder,
    assert_same_messages,
    message_fields,
    run_stage,
    without_cache_control,
)
from pipeline.testing.server import (
    OFFLINE_ANSWER,
    RawReply,
    Reply,
    ScriptedMessagesServer,
    ScriptError,
    compaction_reply,
    count_request_tokens,
    messages_api,
)

__all__ = [
    "OFFLINE_ANSWER",
    "MemoryStore",
    "QuietLogger",
    "RawReply",
    "RecordReads",
    "Reply",
    "ScriptError",
    "ScriptedMessagesServer",
    "SpanRecorder",
    "assert_same_messages",
    "compaction_reply",
    "count_request_tokens",
    "message_fields",
    "messages_api",
    "run_stage",
    "without_cache_control",
]
