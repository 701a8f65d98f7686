"""Test doubles for users of sluicegate (and for its own tests)."""

from pipeline.testing.server import (
    Reply,
    ScriptedMessagesServer,
    ScriptError,
    count_request_tokens,
)

__all__ = ["Reply", "ScriptError", "ScriptedMessagesServer", "count_request_tokens"]
