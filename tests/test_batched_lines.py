"""The server's log lines written in batches (``pipeline._cli.batched_lines``): held lines go in
one write, warnings at once and in order, a bound on what is held, the thread's life."""

from __future__ import annotations

import io
import logging
import logging.config
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline._cli.app import main
from pipeline._cli.batched_lines import HELD_MOST, BatchedLines
from pipeline._cli.logging_setup import configure_logging, say
from pipeline.logs import get_logger


class Writes(io.StringIO):
    """A stream that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            self.writes.append(s)
        return len(s)

    def text(self) -> str:
        with self.lock:
            return "".join(self.writes)


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, Writes, list[BatchedLines]]]:
    """A logger whose handler :func:`make` sets; the handlers closed afterwards."""
    logger = logging.getLogger("sluicegate.test_batched")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    stream = Writes()
    made: list[BatchedLines] = []
    yield logger, stream, made
    for handler in made:
        logger.removeHandler(handler)
        handler.close()


def attach(
    logger: logging.Logger, stream: Writes, made: list[BatchedLines], every: float
) -> BatchedLines:
    handler = BatchedLines(stream, every)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    made.append(handler)
    return handler


def until(check: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def flushers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sluicegate-log-lines"]


def test_info_lines_are_held_and_go_in_one_write(logged) -> None:  # type: ignore[no-untyped-def]
    logger, stream, made = logged
    handler = attach(logger, stream, made, 30.0)
    for k in range(50):
        logger.info("line %d", k)
    assert stream.writes == []  # held (a plain stream handler writes each at once)
    handler.flush()
    assert len(stream.writes) == 1
    assert stream.writes[0] == "".join(f"line {k}\n" for k in range(50))


def test_held_lines_are_written_within_the_interval(logged) -> None:  # type: ignore[no-untyped-def]
    logger, stream, made = logged
    attach(logger, stream, made, 0.05)
    logger.info("soon")
    assert until(lambda: stream.text() == "soon\n")
    logger.info("again")  # the thread, asleep meanwhile, writes the next one too
    assert until(lambda: stream.text() == "soon\nagain\n")


def test_a_warning_goes_at_once_after_the_lines_held(logged) -> None:  # type: ignore[no-untyped-def]
    logger, stream, made = logged
    attach(logger, stream, made, 30.0)
    logger.info("a")
    logger.info("b")
    logger.warning("c")
    assert stream.writes == ["a\nb\nc\n"]
    logger.error("d")
    assert stream.writes == ["a\nb\nc\n", "d\n"]


def test_what_is_held_is_bounded(logged) -> None:  # type: ignore[no-untyped-def]
    logger, stream, made = logged
    handler = attach(logger, stream, made, 30.0)
    line = "x" * 1000
    for _ in range(3 * HELD_MOST // 1000):
        logger.info(line)
        assert handler._held_chars < HELD_MOST  # written once the bound is reached
    assert len(stream.writes) >= 2
    assert all(len(w) <= HELD_MOST + len(line) + 1 for w in stream.writes)


def test_close_writes_what_is_held_and_ends_the_thread(logged) -> None:  # type: ignore[no-untyped-def]
    logger, stream, made = logged
    handler = attach(logger, stream, made, 30.0)
    logger.info("held")
    (thread,) = [t for t in flushers() if t is handler._flusher.thread]  # type: ignore[union-attr]
    handler.close()
    assert stream.text() == "held\n"
    assert until(lambda: not thread.is_alive())


def test_close_under_the_handlers_lock_does_not_wait_for_the_thread(logged) -> None:  # type: ignore[no-untyped-def]
    """``logging.shutdown`` (at exit, and in ``logging.config``) closes a handler holding its
    lock, which a thread about to write waits on: close must not wait for that thread."""
    logger, stream, made = logged

    def slow(s: str) -> int:
        time.sleep(0.2)
        with stream.lock:
            stream.writes.append(s)
        return len(s)

    stream.write = slow  # type: ignore[method-assign]
    handler = attach(logger, stream, made, 0.05)
    logger.info("one")
    time.sleep(0.03)
    began = time.monotonic()
    logging.shutdown([weakref.ref(handler)])
    took = time.monotonic() - began
    assert stream.text() == "one\n"
    assert took < 0.9, took  # one write of 0.2 s; waiting for the thread took the whole 1 s bound


def test_a_forked_child_leaves_the_parents_held_lines_to_the_parent(tmp_path: Path) -> None:
    path = tmp_path / "lines.txt"
    with path.open("a", buffering=1) as stream:
        handler = BatchedLines(stream, 30.0)
        handler.setFormatter(logging.Formatter("%(process)d %(message)s"))
        logger = logging.getLogger("sluicegate.test_batched_fork")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            logger.info("parent's")
            pid = os.fork()
            if pid == 0:  # the child: its own line, written, then gone
                try:
                    logger.info("child's")
                    handler.flush()
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
            handler.flush()
        finally:
            logger.removeHandler(handler)
            handler.close()
    lines = path.read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines].count("parent's") == 1, lines
    assert [line.split(" ", 1)[1] for line in lines].count("child's") == 1, lines


def test_a_line_logged_after_the_exits_logging_shutdown_is_written() -> None:
    script = textwrap.dedent(
        """
        import atexit, sys

        def late():
            import logging
            logging.getLogger("late").info("logged after logging.shutdown")

        atexit.register(late)  # before logging's own hook: runs after it
        import logging
        from pipeline._cli.batched_lines import BatchedLines

        handler = BatchedLines(sys.stderr, 30.0)
        logger = logging.getLogger("late")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.info("during the run")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stderr.splitlines() == ["during the run", "logged after logging.shutdown"]


def test_lines_after_a_close_are_held_again(logged) -> None:  # type: ignore[no-untyped-def]
    """``logging.config`` closes the handlers it replaces, and a logger may go on using one
    (uvicorn's logging configuration closes the proxy's): its lines are still batched."""
    logger, stream, made = logged
    handler = attach(logger, stream, made, 0.05)
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    logger.info("after")
    assert stream.writes == []
    assert until(lambda: stream.text() == "after\n")
    handler.close()


def test_lines_from_many_threads_are_each_written_once_whole(logged) -> None:  # type: ignore[no-untyped-def]
    logger, stream, made = logged
    handler = attach(logger, stream, made, 0.01)

    def log(t: int) -> None:
        for k in range(300):
            logger.info("t%d-%d %s", t, k, "y" * (k % 50))

    threads = [threading.Thread(target=log, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handler.flush()
    lines = stream.text().splitlines()
    assert sorted(lines) == sorted(
        f"t{t}-{k} {'y' * (k % 50)}" for t in range(8) for k in range(300)
    )
    assert len(stream.writes) < len(lines)


def test_a_stream_that_fails_stops_nothing(logged, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    failures: list[object] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    logger, stream, made = logged

    def broken(_s: str) -> int:
        raise OSError("stderr closed")

    stream.write = broken  # type: ignore[method-assign]
    handler = attach(logger, stream, made, 0.01)
    logger.info("lost")
    assert until(lambda: not handler._held)
    assert handler._flusher is not None and handler._flusher.thread.is_alive()
    assert failures == []


@pytest.mark.parametrize("every", [0.0, -1.0, float("nan")])
def test_a_handler_needs_a_positive_interval(every: float) -> None:
    with pytest.raises(ValueError, match="flush_every"):
        BatchedLines(io.StringIO(), every)


def test_a_notice_goes_after_the_lines_held(capsys: pytest.CaptureFixture[str]) -> None:
    restore = configure_logging(1, False, flush_every=30.0)
    try:
        get_logger().info("held.event", k=1)
        say("the notice", "notice")
    finally:
        restore()
    err = capsys.readouterr().err
    assert err.index("held.event") < err.index("the notice")


def test_a_proxy_notice_goes_after_the_lines_held(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline._cli.proxy_cmd import _say

    restore = configure_logging(1, False, flush_every=30.0)
    try:
        get_logger().info("held.event", k=1)
        _say(False, "store.pruned", "the prune's report")
    finally:
        restore()
    err = capsys.readouterr().err
    assert err.index("held.event") < err.index("the prune's report")


@pytest.mark.parametrize("value", ["-1", "61", "nan", "inf", "x", ""])
def test_proxy_refuses_a_bad_log_flush(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["proxy", "--log-flush", value])
    assert exc.value.code == 2
    assert "--log-flush" in capsys.readouterr().err
