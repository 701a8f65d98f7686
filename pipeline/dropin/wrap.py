"""``wrap(client)``: an existing anthropic SDK client whose every Messages request goes through
the pipeline.

The layer is the SDK's own client middleware (``client.with_middleware``): every method that
sends a Messages request -- ``messages.create``, ``messages.stream``, ``beta.messages.*``, the
tool runner -- passes through it, once per HTTP attempt, inside the SDK's retry loop (the
pipeline's output for an unchanged request is the same, so a retry sends the same bytes). Other
requests (``count_tokens``, models, batches) pass untouched. Each conversation gets its
:class:`~pipeline.dropin.adapter.WireSession`, found by the request's credential and messages
(:mod:`pipeline.dropin.conversations`) and kept on disk under ``root``, so a restarted program
continues with the same decisions.

A streamed response is read as it passes to the caller (nothing held back): its id, model and
usage reach the session when the stream has gone by.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.core import Pipeline
from pipeline.dropin.conversations import MAX_HELD
from pipeline.dropin.tenancy import Tenancy
from pipeline.dropin.thread_sync import SYNCS

if TYPE_CHECKING:  # the SDK is heavy to import (~0.8 s, ~60 MB): only a wrapped client needs it
    import anthropic

    from pipeline.dropin.sdk_middleware import SluicegateMiddleware

__all__ = ["SYNCS", "SluicegateMiddleware", "wrap"]

C = TypeVar("C", "anthropic.Anthropic", "anthropic.AsyncAnthropic")


def __getattr__(name: str) -> Any:
    if name == "SluicegateMiddleware":  # the middleware's module imports the SDK
        from pipeline.dropin.sdk_middleware import SluicegateMiddleware

        return SluicegateMiddleware
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wrap(
    client: C,
    *,
    root: str | Path = ".sluicegate",
    pipeline: Callable[[], Pipeline] | None = None,
    session_id: str | None = None,
    tenancy: Tenancy | None = None,
    max_conversations: int | None = MAX_HELD,
    raw_bodies: bool = False,
    long_pass: int | None = None,
    **context: Any,
) -> C:
    """``client`` with every Messages request going through the pipeline (a copy: the client
    given is unchanged). ``pipeline``: a factory of each conversation's stages, required here
    (the library does not import ``stages``); ``stages.wrap`` is this function with the
    default stages (``default_stages(context_window=...)``). ``session_id``: a hint naming
    this client's conversations; ``tenancy``, ``max_conversations``: see
    :class:`SluicegateMiddleware`.

    A request's tenant is the credential it goes with: the SDK puts the client's on each
    request before its middleware, so a copy made with other credentials
    (``with_options(api_key=...)``) is that key's tenant. The wrapped client's credentials and
    default headers are also read here, once, for a request that reaches the middleware
    without them.

    ``raw_bodies=True``: send each prepared body as bytes written here, encoding only what is
    new since the conversation's last call (a long history costs much less to send), for the
    first-party client (others send JSON all the same). Only when no middleware is added after
    this one (``.with_middleware(...)`` on the returned client): such a middleware would see
    the request without its JSON. A non-finite number (NaN, infinity) is refused as the SDK
    refuses it. ``long_pass``: an async client's long first passes off its event loop (see
    :class:`~pipeline.dropin.sdk_middleware.SluicegateMiddleware`)."""
    if pipeline is None:
        raise TypeError(
            "wrap() needs pipeline=: a factory such as lambda: Pipeline(default_stages())"
        )
    from pipeline.dropin.sdk_middleware import SluicegateMiddleware, sends_body_as_given

    middleware = SluicegateMiddleware(
        root=root,
        pipeline=pipeline,
        session_id=session_id,
        tenancy=tenancy,
        client_headers={k: v for k, v in client.default_headers.items() if isinstance(v, str)},
        max_conversations=max_conversations,
        raw_bodies=raw_bodies and sends_body_as_given(client),
        long_pass=long_pass,
        **context,
    )
    return client.with_middleware(middleware)
