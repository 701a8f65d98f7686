"""The drop-ins: sluicegate where a program already calls the Messages API.

- :mod:`.wrap`: ``wrap(client)``, an anthropic SDK client whose every Messages request goes
  through the pipeline;
- :mod:`.proxy`: ``build_app``, a reverse proxy for any program (the ``proxy`` extra), with
  :mod:`.relay` (responses passed on), :mod:`.event_stream` (a stream read as it passes),
  :mod:`.wire_request` (one request's span and log), :mod:`.metrics` and :mod:`.limits`;
- :mod:`.adapter`: :class:`WireSession`, one conversation as it arrives at the wire;
  :mod:`.conversations`: which conversation a request belongs to (:mod:`.tenancy`: whose;
  :mod:`.inheritance`: what one that went another way starts from).

``wrap`` is also ``stages.wrap``, with the default stages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.dropin.adapter import WireSession
    from pipeline.dropin.conversations import Conversations
    from pipeline.dropin.proxy import build_app
    from pipeline.dropin.tenancy import Tenancy
    from pipeline.dropin.wrap import wrap

__all__ = ["Conversations", "Tenancy", "WireSession", "build_app", "wrap"]

_HOME = {
    "Conversations": "pipeline.dropin.conversations",
    "Tenancy": "pipeline.dropin.tenancy",
    "WireSession": "pipeline.dropin.adapter",
    "build_app": "pipeline.dropin.proxy",
    "wrap": "pipeline.dropin.wrap",
}


def __getattr__(name: str) -> Any:
    # imported on first use: a module of this package never loads the others with it
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
