"""The drop-ins: sluicegate where a program already calls the Messages API.

- :mod:`.wrap`: ``wrap(client)``, an anthropic SDK client whose every Messages request goes
  through the pipeline;
- :mod:`.proxy`: ``build_app``, a reverse proxy for any program (the ``proxy`` extra), with
  :mod:`.relay` (responses passed on), :mod:`.event_stream` (a stream read as it passes),
  :mod:`.wire_request` (one request's span and log), :mod:`.metrics` and :mod:`.limits`;
- :mod:`.adapter`: :class:`WireSession`, one conversation as it arrives at the wire
  (:mod:`.calibration`: when its token calibration is written);
  :mod:`.conversations`: which conversation a request belongs to (:mod:`.tenancy`: whose;
  :mod:`.inheritance`: what one that went another way starts from).

``wrap`` is also ``stages.wrap``, with the default stages.
"""

from pipeline.dropin.adapter import WireSession
from pipeline.dropin.conversations import Conversations
from pipeline.dropin.tenancy import Tenancy
from pipeline.dropin.wrap import wrap

# the proxy (``pipeline.dropin.proxy.build_app``) is not imported here: it needs the proxy extra
__all__ = ["Conversations", "Tenancy", "WireSession", "wrap"]
