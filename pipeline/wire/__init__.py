"""The wire form of a request: what of the conversation goes to the Messages API, and how.

- :mod:`.form`: ``to_api``, the ``messages`` array built from conversation records;
  :mod:`.cache`: :class:`WireCache`, the same across calls at the cost of what changed;
- :mod:`.encoding`: text every request can carry, and request bodies read and written fast;
  :mod:`.body_reader`: a body parsed in the size of what is new in it;
- :mod:`.caching`: prompt-cache breakpoints; :mod:`.digests`: what tells one conversation's
  messages from another's; :mod:`.harness`: text a harness attached to a tool result;
  :mod:`.request_fields`: what the stages ask of a request beyond its messages;
  :mod:`.pairing`: every tool call answered once, the check before a request goes.

Nothing here sends anything: the drop-ins (:mod:`pipeline.dropin`) do.
"""

from pipeline.wire.cache import WireCache, request_chars
from pipeline.wire.form import to_api, wire_positions

__all__ = ["WireCache", "request_chars", "to_api", "wire_positions"]
