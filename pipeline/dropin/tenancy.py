"""Tenants: whose conversation a request is, told by the credential it carries.

A drop-in (a proxy a team shares, a wrapped client) sees requests from several API keys. Every
conversation, record and persisted file is kept under the tenant of the request that made it,
so a client can neither read nor change another key's state, whatever conversation it names.
A tenant is a keyed digest of the request's ``x-api-key`` and ``Authorization`` headers
(HMAC-SHA-256 under a secret of the store's), never the credential itself: the name
``t-<20 hex>`` can stand in a path, a log line or a span without giving the key away.

The secret is the store's own: made at random the first time (``<root>/tenant-secret``, 0600;
``<prefix>/tenant-secret`` on an object store, created exclusively so every worker of a fleet
reads the same one) unless one is given. ``Tenancy(single=True)`` puts every request under one
tenant, ``shared``: for a single user, or a trusted team that wants one set of conversations.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

__all__ = ["CREDENTIAL_HEADERS", "SHARED_TENANT", "TENANT_PATTERN", "Tenancy", "credential_of"]

SHARED_TENANT = "shared"
"""The tenant of every request under ``Tenancy(single=True)``."""
TENANT_PATTERN = re.compile(r"t-[0-9a-f]{20}|shared")
"""Every name a tenant gets (what a store's tenant directories are called)."""
CREDENTIAL_HEADERS = ("x-api-key", "authorization")
"""The headers whose values are a request's credential (names in lower case)."""
MIN_SECRET_BYTES = 16


class Tenancy:
    """How requests are told apart: ``tenant_of(headers)`` names the tenant of a request.

    ``secret``: the key of the digest (at least 16 bytes); ``single``: one tenant for every
    request (no secret needed). ``ValueError`` for a short secret.
    """

    def __init__(self, secret: bytes | None = None, *, single: bool = False) -> None:
        if not single and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            raise ValueError(f"a tenancy secret must be at least {MIN_SECRET_BYTES} bytes")
        self.single = single
        self._secret = secret or b""

    def __repr__(self) -> str:
        return "Tenancy(single=True)" if self.single else "Tenancy(secret=...)"

    def tenant_of(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request with these headers (names matched without case): the same
        credentials always give the same tenant, different ones different tenants; a request
        without any is a tenant of its own (the one of no credential)."""
        if self.single:
            return SHARED_TENANT
        mac = hmac.new(self._secret, credential_of(headers), hashlib.sha256)
        return "t-" + mac.hexdigest()[:20]


def credential_of(headers: Mapping[str, str]) -> bytes:
    """The credential a request carries, as one byte string (its ``x-api-key`` and
    ``Authorization`` headers, names matched without case; empty values where it has none):
    what a tenant is a digest of. Secret: digest it before keeping it."""
    found = {k.lower(): v for k, v in headers.items() if k.lower() in CREDENTIAL_HEADERS}
    material = "\n".join(f"{name}:{found.get(name, '')}" for name in CREDENTIAL_HEADERS)
    return material.encode("utf-8", "surrogatepass")
