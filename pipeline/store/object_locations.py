"""Where an object store is and how its client is made: a store URL checked and taken apart
(:func:`parse_url`), the obstore client built from it (:func:`build_store`) with bounds on the
requests a client waits on (:func:`in_turn_options`), and a URL as safe to show in an error
(:func:`shown`). :mod:`pipeline.store.sessions` opens sessions' state on what this builds."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pipeline.store.objects import ObjectStoreAPI

__all__ = [
    "STORE_RETRIES",
    "STORE_TIMEOUT",
    "build_store",
    "in_turn_options",
    "parse_url",
    "shown",
]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket naming rules (the part that matters here: no slash, no case, no space)."""
_CONTAINER = re.compile(r"(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")
"""Azure Blob Storage's container naming rules."""

STORE_TIMEOUT = 3.0
"""Seconds one object-store request may take (connecting: at most 1 s of it) by default."""
STORE_RETRIES = 2
"""Retries of a failed object-store request by default (connection errors, 5xx, timeouts)."""

_CLIENT_KEYS = (
    "allow_http",
    "allow_invalid_certificates",
    "connect_timeout",
    "default_content_type",
    "http1_only",
    "http2_keep_alive_interval",
    "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle",
    "http2_only",
    "pool_idle_timeout",
    "pool_max_idle_per_host",
    "proxy_url",
    "proxy_ca_certificate",
    "proxy_excludes",
    "randomize_addresses",
    "read_timeout",
    "timeout",
    "user_agent",
)
"""obstore's HTTP client options that it also reads from ``AWS_<KEY>`` (S3) or ``AZURE_<KEY>``
(Azure) variables."""


def in_turn_options(timeout: float = STORE_TIMEOUT, retries: int = STORE_RETRIES) -> dict[str, Any]:
    """obstore options for requests a client waits on: each request at most ``timeout``
    seconds (connecting at most 1 s of it), ``retries`` retries after a short backoff, no retry
    started after ``timeout * (retries + 1)`` seconds. ``ValueError`` for a timeout that is not
    a positive number of seconds up to 600, or retries outside 0-10."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (0 < timeout <= 600)
    ):
        raise ValueError(f"a store timeout must be from 0 (exclusive) to 600 s, got {timeout!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
        raise ValueError(f"store retries must be a whole number from 0 to 10, got {retries!r}")
    return {
        "client_options": {
            "timeout": timedelta(seconds=timeout),
            "connect_timeout": timedelta(seconds=min(timeout, 1.0)),
        },
        "retry_config": {
            "max_retries": retries,
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(milliseconds=500),
            },
            "retry_timeout": timedelta(seconds=timeout * (retries + 1)),
        },
    }


def parse_url(text: str) -> tuple[str, str, str]:
    """(kind, URI base, key prefix path) of a store URL; ``ValueError`` for a bad one."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"malformed store URL {shown(text)}") from None
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        # credentials belong in the environment or the options, never in a URL that is logged
        raise ValueError(f"store URL {shown(text)}: credentials in the URL are not accepted")
    if parts.query or parts.fragment or port is not None:
        raise ValueError(f"store URL {shown(text)}: no port, query or fragment expected")
    if scheme == "s3":
        if not _BUCKET.fullmatch(parts.hostname or "") or parts.netloc != parts.hostname:
            raise ValueError(f"store URL {shown(text)}: not a valid S3 bucket name")
        return "s3", f"s3://{parts.netloc}", parts.path
    if scheme == "az":
        if not _CONTAINER.fullmatch(parts.hostname or "") or parts.netloc != parts.hostname:
            raise ValueError(f"store URL {shown(text)}: not a valid Azure container name")
        return "azure", f"az://{parts.netloc}", parts.path
    if scheme == "memory":
        if parts.netloc:
            raise ValueError(f"store URL {shown(text)}: a memory URL has no host (memory:///x)")
        return "memory", "memory://", parts.path
    raise ValueError(
        f"unsupported store URL scheme {scheme[:20]!r} in {shown(text)}: give a local "
        "directory, s3://bucket/prefix, az://container/prefix or memory:///prefix"
    )


def shown(url: str) -> str:
    """A URL as safe to put in an error: scheme and host only (a userinfo part or a query may
    hold a secret), bounded."""
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return repr(f"{scheme[:20]}{sep}{host[:100]}/...")


def build_store(kind: str, uri_base: str, options: dict[str, Any]) -> ObjectStoreAPI:
    from obstore.exceptions import BaseError
    from obstore.store import AzureStore, MemoryStore, S3Store

    if kind == "memory":
        if options:
            raise ValueError("a memory store takes no options")
        return MemoryStore()
    env = "AZURE" if kind == "azure" else "AWS"
    options = _with_in_turn_defaults(options, env)
    try:
        # the bucket (container) only: the key prefix is ours to apply (in every key and URI)
        if kind == "azure":
            return AzureStore.from_url(uri_base, **options)
        return S3Store.from_url(uri_base, **options)
    except (BaseError, TypeError) as exc:
        what = "Azure" if kind == "azure" else "S3"
        raise ValueError(
            f"cannot configure the {what} store {shown(uri_base)}: {str(exc)[:300]}"
        ) from None


def _with_in_turn_defaults(options: dict[str, Any], env: str = "AWS") -> dict[str, Any]:
    """``options`` over :func:`in_turn_options`. Client options given in code win over
    ``<env>_<KEY>`` variables (``AWS_``, ``AZURE_``), which win over the defaults: obstore
    drops the environment's client options (``AWS_ALLOW_HTTP`` among them) once any are
    passed, so they are read here."""
    defaults = in_turn_options()
    given = options.get("client_options")
    if given is not None and not isinstance(given, Mapping):
        raise ValueError("client_options must be a mapping of obstore client options")
    from_env = {
        key: value
        for key in _CLIENT_KEYS
        if (value := os.environ.get(f"{env}_{key.upper()}")) is not None
    }
    merged = {**defaults, **options}
    merged["client_options"] = {**defaults["client_options"], **from_env, **(given or {})}
    return merged
