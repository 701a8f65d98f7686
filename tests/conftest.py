"""Shared fixtures: where the corpus is, and small builders for conversations."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog
from hypothesis import settings

from tests.sdk_support import close_sdk_clients

if TYPE_CHECKING:
    from tests.objectstore_support import Azurite, MotoS3

CORPUS = Path(
    os.environ.get("SLUICEGATE_CORPUS", Path(__file__).resolve().parents[2] / "shared" / "corpus")
)

# The property runs draw the same examples on every run, so a failure is one anybody can
# reproduce; SLUICEGATE_HYPOTHESIS=explore draws new ones each run (to hunt for more).
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("SLUICEGATE_HYPOTHESIS", "fixed"))

# A test run started in the background by a shell without job control (``./.ci/run &``)
# inherits SIGINT ignored, and so would every command the tests start: Ctrl-C, the graceful
# stop they send the proxy and the replay, would never arrive. The tests' own process takes
# Python's handler back, so the commands they start get the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def corpus_sessions() -> list[Path]:
    """Every Claude Code session file of the corpus (main sessions and sub-agent files)."""
    if not CORPUS.is_dir():
        return []
    return sorted(CORPUS.glob("claude-code_*/**/*.jsonl"))


def corpus_params() -> list[object]:
    """``pytest.mark.parametrize`` values over the corpus, or one skipped value without it."""
    files = corpus_sessions()
    if not files:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no corpus at {CORPUS}"))]
    return [pytest.param(f, id=str(f.relative_to(CORPUS))) for f in files]


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    """Close the SDK clients the test made (``tests.sdk_support.sdk_client``)."""
    yield
    close_sdk_clients()


@pytest.fixture(autouse=True)
def _structlog_as_it_was() -> Iterator[None]:
    """structlog's global configuration as it was before the test. ``capture_logs`` leaves
    structlog configured (with its defaults) even where it was not, and the library's loggers
    then take the application's path instead of the standard library's: a later test in the
    same worker would see that."""
    saved = structlog.get_config() if structlog.is_configured() else None
    yield
    if saved is not None:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()


@pytest.fixture
def structlog_unconfigured() -> None:
    """structlog as an application that never configured it has it (the autouse fixture
    above puts back what was there)."""
    structlog.reset_defaults()


@pytest.fixture
def store_root(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory for a session store."""
    root = tmp_path / "store"
    yield root


@pytest.fixture
def umask_zero() -> Iterator[None]:
    """A umask of 0 for the test: modes the code sets must not come from the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """Azurite's Azure Blob server on 127.0.0.1 for this test process (skipped where there is
    no Node, or it cannot be installed or started); each test takes a new container."""
    from tests.objectstore_support import start_azurite

    server = start_azurite(tmp_path_factory.mktemp("azurite"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 API server on 127.0.0.1 for this test process (skipped when it cannot start);
    each test takes a new bucket (``moto_s3.new_bucket()``)."""
    from tests.objectstore_support import start_moto

    server = start_moto()
    try:
        yield server
    finally:
        server.stop()
