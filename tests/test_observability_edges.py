"""Edges of the observability and retention work: credentials never shown, a malformed OTLP
endpoint never a traceback, a pruned name re-written meanwhile kept, reuse refreshing age, and
the periodic prune leaving directories in place."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import anyio
import pytest

import pipeline.store.retention as retention
from pipeline.store.files import FileToolResultStore
from pipeline.store.retention import prune_store
from tests.cli_support import clean_env, run_cli


def _closing_server() -> tuple[socket.socket, int]:
    """A port that accepts connections and closes them at once."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(50)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, int(srv.getsockname()[1])


def test_a_failed_export_never_shows_the_endpoints_credentials() -> None:
    srv, port = _closing_server()
    try:
        code = (
            "from pipeline._cli.telemetry import setup_tracing\n"
            "from pipeline.tracing import get_tracer\n"
            "p = setup_tracing(False)\n"
            "with get_tracer(p).start_as_current_span('x'): pass\n"
            "p.shutdown()\n"
        )
        env = clean_env(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"user:s3cret@127.0.0.1:{port}/v1/traces?token=t0k",
            OTEL_EXPORTER_OTLP_TIMEOUT="2",
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
    finally:
        srv.close()
    assert "sluicegate: warning:" in done.stderr
    assert "s3cret" not in done.stderr and "t0k" not in done.stderr


def test_a_malformed_endpoint_is_a_warning_not_a_traceback(tmp_path: Path) -> None:
    env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT="http://[::1", OTEL_EXPORTER_OTLP_TIMEOUT="1")
    done = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "not a valid URL" in done.stderr


def test_a_name_written_again_after_the_scan_is_not_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileToolResultStore(tmp_path, "sess")
    path = anyio.run(store.persist, "toolu_1", "big result", "txt")
    old = time.time() - 10 * 86_400
    os.utime(path, (old, old))
    chosen = retention._choose

    def meanwhile(*args: object, **kw: object) -> object:
        doomed = chosen(*args, **kw)  # type: ignore[arg-type]
        os.unlink(path)  # another prune, or the user, removes it; a live session writes it again
        again = anyio.run(store.persist, "toolu_1", "big result", "txt")
        assert again == path
        return doomed

    monkeypatch.setattr(retention, "_choose", meanwhile)
    report = prune_store(tmp_path, max_age=timedelta(days=1))
    assert report.removed == [] and Path(path).exists()


def test_reusing_a_result_refreshes_its_age(tmp_path: Path) -> None:
    store = FileToolResultStore(tmp_path, "sess")
    path = anyio.run(store.persist, "toolu_1", "same bytes", "txt")
    old = time.time() - 10 * 86_400
    os.utime(path, (old, old))
    assert anyio.run(store.persist, "toolu_1", "same bytes", "txt") == path  # a resumed session
    assert time.time() - os.stat(path).st_mtime < 60
    assert prune_store(tmp_path, max_age=timedelta(days=1)).removed == []


def test_the_periodic_prune_leaves_directories_for_live_sessions(tmp_path: Path) -> None:
    store = FileToolResultStore(tmp_path, "sess")
    path = anyio.run(store.persist, "toolu_1", "old", "txt")
    old = time.time() - 10 * 86_400
    os.utime(path, (old, old))

    async def run_once() -> None:
        with anyio.fail_after(30):  # a hang guard: the prune comes within one 0.05 s interval
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    partial(
                        retention.prune_periodically,
                        tmp_path,
                        interval=0.05,
                        max_age=timedelta(days=1),
                    )
                )
                while Path(path).exists():
                    await anyio.sleep(0.02)
                tg.cancel_scope.cancel()

    anyio.run(run_once)
    assert not Path(path).exists()
    assert (tmp_path / "sess" / "tool-results").is_dir()  # a persist may be about to use it
