"""Real object-store servers for the object-store tests -- moto's S3 API and Azurite's Azure
Blob API, on 127.0.0.1 -- and store wrappers that put one fault at one call while the real
store does the rest."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

obstore = pytest.importorskip("obstore", reason="the objectstore extra (obstore) is not installed")
from obstore.store import AzureStore, S3Store  # noqa: E402

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
    scheme = "s3"

    def url(self, bucket: str, prefix: str) -> str:
        """The ``--store`` URL of ``prefix`` in ``bucket``."""
        return f"s3://{bucket}/{prefix}"

    def again(self) -> MotoS3:
        """A server on this one's port serving what it held (after :meth:`stop`)."""
        return start_moto(int(self.endpoint.rsplit(":", 1)[1]))

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


class Outage:
    """A fault hook (for :class:`Wrapped`'s ``before``): raises ``OSError`` while ``down``, as an
    unreachable store's call does; ``hooks()`` puts it before every call."""

    def __init__(self, down: bool = True, message: str = "the store is unreachable (test)"):
        self.down = down
        self.message = message

    def __call__(self, *_args: Any, **_kwargs: Any) -> None:
        if self.down:
            raise OSError(self.message)

    def hooks(self) -> dict[str, Callable[..., None]]:
        """``before`` for :class:`Wrapped`: this fault before each of the store's calls."""
        return dict.fromkeys(("put", "get", "head", "list", "list_with_delimiter", "delete"), self)


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

    def delete(self, paths: Any) -> None:
        self._hook("delete", paths)
        self.inner.delete(paths)


# ---------------------------------------------------------------------------------------------
# Azurite: Azure Blob Storage's emulator (npm), where Node is present
# ---------------------------------------------------------------------------------------------

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
"""The emulator's well-known development account and key (public: Azurite's documentation)."""
AZURITE_VERSION = "3"
_AZURITE_CACHE = Path(
    os.environ.get("SLUICEGATE_TEST_CACHE") or Path.home() / ".cache" / "sluicegate-tests"
)


def azurite_command() -> str | None:
    """``azurite-blob``: on the PATH, else installed once with npm into the tests' cache
    (``~/.cache/sluicegate-tests``); None where there is no Node or the install fails."""
    found = shutil.which("azurite-blob")
    if found:
        return found
    cached = _AZURITE_CACHE / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if cached.exists():
        return str(cached)
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        return None
    lock = _AZURITE_CACHE / "azurite.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)  # one install, whichever test worker comes first
        if not cached.exists():
            try:
                subprocess.run(
                    [npm, "install", "--no-audit", "--no-fund", "--prefix",
                     str(cached.parents[2]), f"azurite@{AZURITE_VERSION}"],
                    check=True, capture_output=True, timeout=600,
                )  # fmt: skip
            except (OSError, subprocess.SubprocessError):
                return None
    return str(cached) if cached.exists() else None


@dataclass
class Azurite:
    """A running Azurite blob server (a child process), its data in ``location``."""

    process: subprocess.Popen[bytes]
    endpoint: str
    location: Path
    scheme = "az"

    def new_bucket(self) -> str:
        """A new, empty container (named as a bucket is, for the tests shared with S3)."""
        name = f"sg-{uuid.uuid4().hex[:20]}"
        date = email.utils.formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
        content_type = "application/octet-stream"
        signed = "\n".join(
            [
                "PUT", "", "", "", "", content_type, "", "", "", "", "", "",
                *(f"{k}:{v}" for k, v in sorted(headers.items())),
                f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container",
            ]
        )  # fmt: skip
        key = base64.b64decode(AZURITE_KEY)
        signature = base64.b64encode(hmac.new(key, signed.encode(), hashlib.sha256).digest())
        request = urllib.request.Request(
            f"{self.endpoint}/{AZURITE_ACCOUNT}/{name}?restype=container",
            method="PUT",
            data=b"",
            headers={
                **headers,
                "Content-Type": content_type,
                "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{signature.decode()}",
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 201
        return name

    def url(self, bucket: str, prefix: str) -> str:
        """The ``--store`` URL of ``prefix`` in container ``bucket``."""
        return f"az://{bucket}/{prefix}"

    def store(self, bucket: str, **options: Any) -> AzureStore:
        """A new client of container ``bucket`` (a separate connection pool: another worker)."""
        return AzureStore(
            bucket,
            account_name=AZURITE_ACCOUNT,
            account_key=AZURITE_KEY,
            endpoint=f"{self.endpoint}/{AZURITE_ACCOUNT}",
            client_options={"allow_http": True},
            retry_config=FAST_RETRIES,
            **options,
        )

    def env(self) -> dict[str, str]:
        """What a worker process needs to reach this server."""
        return {
            "AZURE_STORAGE_ENDPOINT": f"{self.endpoint}/{AZURITE_ACCOUNT}",
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
            "AZURE_ALLOW_HTTP": "true",
        }

    def stop(self) -> None:
        """Stop the server (its data stays in :attr:`location`)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)

    def again(self) -> Azurite:
        """A server on this one's port serving what it held (after :meth:`stop`)."""
        return start_azurite(self.location, int(self.endpoint.rsplit(":", 1)[1]))


def start_azurite(location: Path, port: int = 0) -> Azurite:
    """Start Azurite's blob server on 127.0.0.1 (``port`` 0: a free one), its data in
    ``location`` (the caller's to remove); skip when there is no Node, Azurite cannot be
    installed, or it does not start."""
    command = azurite_command()
    if command is None:
        pytest.skip("Azurite is not available (no Node/npm, or `npm install azurite` failed)")
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            command, "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--location", str(location), "--silent", "--skipApiVersionCheck",
            "--disableTelemetry",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.skip("Azurite's blob server did not start on 127.0.0.1")
            time.sleep(0.1)
    return Azurite(process, endpoint, location)
