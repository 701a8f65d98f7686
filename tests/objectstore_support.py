"""A real S3 API server for the object-store tests (moto's, on 127.0.0.1) and store wrappers
that put one fault at one call while the real store does the rest."""

from __future__ import annotations

import logging
import threading
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

obstore = pytest.importorskip("obstore", reason="the objectstore extra (obstore) is not installed")
from obstore.store import S3Store  # noqa: E402

ACCESS_KEY = "AKIDSLUICEGATETEST"
SECRET_KEY = "sluicegate-test-secret-7f3a9c"
"""Credentials the tests give the S3 client: moto accepts any; no error text may show them."""
REGION = "us-east-1"
FAST_RETRIES: dict[str, Any] = {
    "max_retries": 1,
    "backoff": {
        "init_backoff": timedelta(milliseconds=10),
        "max_backoff": timedelta(milliseconds=20),
    },
    "retry_timeout": timedelta(seconds=5),
}
"""A failing request fails after one retry, not after obstore's default 10 (a stopped server)."""


@dataclass
class MotoS3:
    """A running moto S3 server."""

    server: Any
    endpoint: str

    def new_bucket(self) -> str:
        """A new, empty bucket (moto's state is process-wide: every test takes its own)."""
        name = f"sg-{uuid.uuid4().hex[:20]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        return name

    def store(self, bucket: str, **options: Any) -> S3Store:
        """A new S3 client of ``bucket`` (a separate connection pool: another worker)."""
        return S3Store(bucket, **self.options(), **options)

    def options(self) -> dict[str, Any]:
        """What an S3 client of this server needs besides the bucket."""
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
            "client_options": {"allow_http": True},
            "retry_config": FAST_RETRIES,
        }

    def env(self) -> dict[str, str]:
        """The same, as the environment variables a worker process would have."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def stop(self) -> None:
        """Stop the server: every later request to it fails to connect (refused: moto's own
        stop leaves the socket listening, where a request would hang until its timeout)."""
        self.server.stop()
        inner = getattr(self.server, "_server", None)
        if inner is not None:
            inner.server_close()


def start_moto(port: int = 0) -> MotoS3:
    """Start moto's S3 server on 127.0.0.1, on ``port`` (0: one the system picks); skip when
    it cannot. moto keeps its buckets per process, not per server: a server started again on
    the port of a stopped one serves what that one held (a store that comes back)."""
    server_module = pytest.importorskip(
        "moto.server", reason="moto[server] is not installed (the dev extra has it)"
    )
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    # start() waits forever for a server thread that died binding: wait from another thread
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    starter.join(timeout=60)
    if starter.is_alive():
        pytest.skip("moto's S3 server did not start on 127.0.0.1 (no local socket?)")
    host, port = server.get_host_and_port()
    return MotoS3(server, f"http://{host}:{port}")


def keys_of(store: Any, prefix: str | None = None) -> list[str]:
    """Every key under ``prefix``, sorted."""
    return sorted(meta["path"] for chunk in store.list(prefix) for meta in chunk)


@dataclass
class Wrapped:
    """A real store with a hook before each call (:class:`~pipeline.store.objects.ObjectStoreAPI`):
    ``before[name](*args, **kwargs)`` may raise (a fault) or change nothing; ``calls`` counts
    each call by name and ``gets`` keeps each get's key and options."""

    inner: Any
    before: dict[str, Callable[..., None]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    gets: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stale_lists: int = 0
    """The next this many listings return nothing (a listing that lags the writes)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _hook(self, name: str, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        hook = self.before.get(name)
        if hook is not None:
            hook(*args, **kwargs)

    def put(self, path: str, file: bytes, *, mode: Any = None) -> Any:
        self._hook("put", path, file, mode=mode)
        return self.inner.put(path, file, mode=mode)

    def get(self, path: str, *, options: Any = None) -> Any:
        self._hook("get", path, options=options)
        with self.lock:
            self.gets.append((path, dict(options or {})))
        return self.inner.get(path, options=options)

    def head(self, path: str) -> Any:
        self._hook("head", path)
        return self.inner.head(path)

    def list(self, prefix: str | None = None, *, offset: str | None = None) -> Sequence[Any]:
        self._hook("list", prefix, offset=offset)
        with self.lock:
            if self.stale_lists:
                self.stale_lists -= 1
                return []
        return list(self.inner.list(prefix, offset=offset))

    def list_with_delimiter(self, prefix: str | None = None) -> Any:
        self._hook("list_with_delimiter", prefix)
        return self.inner.list_with_delimiter(prefix)
