"""``proxy``: the Messages API reverse proxy (see :mod:`pipeline.dropin.proxy`), served by
uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import logging
import socket
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeline._cli.allocator import (
    HEAP_BLOCKS,
    IDLE_TRIM,
    KEEP_FREED,
    IdleTrim,
    heap_trimmer,
    tune_allocator,
)
from pipeline._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    ReplayOptions,
    object_store_states,
    telemetry,
)
from pipeline._cli.logging_setup import flush_held_lines
from pipeline._cli.safe_text import terminal_safe
from pipeline._cli.store_cmd import describe, warn_errors
from pipeline.dropin.limits import MAX_HEAD_BYTES
from pipeline.dropin.metrics import WireMetrics
from pipeline.dropin.tenancy import Tenancy
from pipeline.logs import get_logger
from pipeline.policies import ToolPolicies
from pipeline.store.retention import PruneReport, prune_periodically, prune_store
from pipeline.store.sessions import SessionStates
from pipeline.store.spool import SPOOL_DIR
from pipeline.transcript.open_files import OPEN_FILES

PRUNE_INTERVAL = 3_600.0
"""Seconds between two prunes of the store while the proxy runs (``--retain``,
``--max-store-size``)."""

_PREFIX = "sluicegate proxy"
_BACKLOG = 2_048


def cmd_proxy(args: argparse.Namespace) -> int:
    """Serve the proxy until interrupted (SIGINT/SIGTERM: a graceful shutdown, exit 0)."""
    try:
        import uvicorn

        from pipeline._cli.http_protocols import head_timed, http_parser
        from pipeline._cli.serving import (
            AcceptRetryAfterClose,
            OnceIn,
            connection_cap,
            raise_open_files,
            records_held_open,
        )
        from pipeline.dropin.proxy import LONG_PASS, build_app
    except ImportError:
        raise CliError("the proxy needs its extra: pip install 'sluicegate[proxy]'") from None
    parts = urlsplit(args.upstream)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"--upstream must be an http(s) URL, got {args.upstream[:80]!r}")
    options = ReplayOptions.from_args(args)
    options.pipeline()  # a bad --stage is refused before the server starts
    # the token calibration is per host: on a local directory even when the state is shared;
    # so is the spool of results an object store could not take
    root = options.store or Path(".sluicegate")
    shared = object_store_states(args, spool=root / SPOOL_DIR)
    if shared is not None and (args.retain is not None or args.max_store_size is not None):
        raise CliError(
            "--retain and --max-store-size prune a local --store; on s3:// expire the "
            "objects under the prefix with the bucket's lifecycle rules instead"
        )
    # a server logs each request (INFO) unless told less: -v adds debug
    with telemetry(args, metrics=True, verbosity=1, log_flush=args.log_flush) as set_up:
        background = retention(args, root) if shared is None else []
        if shared is not None:
            _check_store(shared, args.log_json)
        try:
            parser = http_parser(args.http)
        except ImportError:
            raise CliError("--http httptools: httptools is not installed") from None
        loop = event_loop(args.loop)
        client = _upstream_client(args.upstream_client)
        open_files = raise_open_files()
        # each conversation held keeps its record file open: no call opens it again
        OPEN_FILES.limit = records_held_open(open_files, args.max_conversations)
        connections = args.max_connections or connection_cap(open_files, OPEN_FILES.limit)
        context: dict[str, Any] = {}
        if set_up.tracer is not None:
            context["tracer"] = set_up.tracer
        app = build_app(
            pipeline=options.pipeline,
            root=root,
            upstream=args.upstream,
            tool_policies=ToolPolicies.claude_code(cap=options.per_tool_chars),
            cache_breakpoint=args.cache_breakpoint,
            background=background,
            storage=shared,
            tenancy=Tenancy(single=True) if args.single_tenant else None,
            metrics=WireMetrics(set_up.meter_provider),
            max_body_bytes=args.max_body,
            body_timeout=args.body_timeout,
            upstream_timeout=args.upstream_timeout,
            max_conversations=args.max_conversations,
            max_held_bytes=args.max_held_size,
            max_branches=args.max_branches,
            max_upstream_connections=connections,
            fsync_each=args.fsync_each,
            long_pass=LONG_PASS,  # its stages have no summarizer: their work is bound to no loop
            upstream_client=client,
            **context,
        )
        # for the process's life: glibc's moving thresholds cannot be had back
        untuned = "--system-allocator" if args.system_allocator else tune_allocator()
        trim = heap_trimmer() if untuned is None else None
        served: Any = app if trim is None else IdleTrim(app, trim)
        sock = _listen(args.host, args.port)
        port = sock.getsockname()[1]
        where = f"http://{args.host}:{port}"
        log = get_logger()

        def ready() -> None:
            if args.log_json:  # every line of a JSON log is JSON, the banner too
                log.info(
                    "proxy.listening",
                    url=where,
                    upstream=args.upstream,
                    store=shared.location if shared is not None else str(root),
                )
                return
            store = f"; store {terminal_safe(shared.location)}" if shared is not None else ""
            flush_held_lines()
            print(
                f"sluicegate proxy on {where} -> {args.upstream} "
                f"(ANTHROPIC_BASE_URL={where}){store}",
                file=sys.stderr,
                flush=True,
            )

        server = _announcing(
            uvicorn.Config(
                served,
                # under --log-json its lines go through the JSON handler (logging_setup)
                log_config=None if args.log_json else uvicorn.config.LOGGING_CONFIG,
                log_level="warning",
                http=head_timed(args.header_timeout, parser),
                loop=loop,
                h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                # a relayed answer carries the upstream's own: one of each, not two
                server_header=False,
                date_header=False,
                limit_concurrency=connections,
            ),
            ready,
        )
        # at the descriptor limit asyncio logs each failed accept: one line in a while
        asyncio_log = logging.getLogger("asyncio")
        asyncio_log.addFilter(OnceIn("out of system resource"))
        asyncio_log.addFilter(AcceptRetryAfterClose())
        # and uvicorn's line for each request answered 503 past --max-connections
        logging.getLogger("uvicorn.error").addFilter(OnceIn("Exceeded concurrency limit"))
        if untuned is None:
            log.debug(
                "proxy.allocator",
                heap_blocks=HEAP_BLOCKS,
                keep_freed=KEEP_FREED,
                idle_trim=IDLE_TRIM if trim is not None else None,
            )
        else:
            log.debug("proxy.allocator", left_alone=untuned)
        log.debug("proxy.serving", http=parser, loop=loop, upstream_client=client)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM (requests in flight finish), then
        # raises the signal again: for a service that is the normal stop, exit 0
        with contextlib.suppress(KeyboardInterrupt), server_collector(), server_switching():
            server.run(sockets=[sock])
        log.info("proxy.stopped", url=where)
    return EXIT_OK


def event_loop(wanted: str) -> str:
    """``--loop``, checked: ``auto`` is ``uvloop`` where it can be imported, else ``asyncio``;
    uvloop asked for by name must be there."""
    if wanted == "asyncio":
        return wanted
    if importlib.util.find_spec("uvloop") is None:
        if wanted == "uvloop":
            raise CliError("--loop uvloop: uvloop is not installed")
        return "asyncio"
    return "uvloop"


def _upstream_client(wanted: str) -> str:
    """``--upstream-client``, checked: the client the calls go out with on the proxy's loop;
    httptools or aiohttp asked for by name must be there."""
    from pipeline.dropin.upstream import choose_client

    try:
        return choose_client(wanted)
    except ValueError as exc:
        raise CliError(f"--upstream-client {wanted}: {str(exc).split(': ', 1)[-1]}") from None


def _announcing(config: Any, ready: Callable[[], None]) -> Any:
    """uvicorn's server for ``config``, announcing itself (``ready``) once it serves: its signal
    handlers are in place only once it runs, so a Ctrl-C after the banner is always its
    graceful stop (before them, Python's own handler raises wherever the start-up stands).
    uvicorn is the proxy extra's: imported here, not with the module."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                ready()

    return Server(config)


SERVER_GC_THRESHOLDS = (20_000, 20, 20)
"""The collector's thresholds while the proxy serves (Python's are 700, 10, 10)."""


@contextlib.contextmanager
def server_collector() -> Iterator[None]:
    """The garbage collector set for a long-lived server while the block runs, then as it
    was: what start-up made (modules, classes, the app) is frozen out of every collection,
    and the young generation is collected every 20,000 allocations, not 700. The
    conversations' parsed messages are long-lived containers: with Python's thresholds,
    under 16 conversations at once the collector took ~0.3 ms a request and paused the loop
    70-120 ms at each full collection. Garbage is still freed by reference counting at once;
    only reference cycles wait longer. What was frozen before stays frozen (a freeze cannot be
    undone in part: then nothing is unfrozen)."""
    saved = gc.get_threshold()
    frozen = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*saved)
        if not frozen:
            gc.unfreeze()


SERVER_SWITCH_INTERVAL = 0.001
"""Seconds a thread holds the interpreter while another waits, while the proxy serves (Python's
default is 0.005)."""


@contextlib.contextmanager
def server_switching() -> Iterator[None]:
    """The interpreter's switch interval set to :data:`SERVER_SWITCH_INTERVAL` while the block
    runs, then as it was. A conversation met first with many messages has its first pass run in
    a worker thread, off the event loop, yet a thread running Python holds the interpreter: the
    loop, serving every other conversation, waited up to 5 ms each time it needed it back. With
    1 ms, a 10-message conversation's calls beside new 1,000-message ones took half as long at
    the median and the 99th percentile; the long first calls took ~25% longer. With no thread
    waiting (a pass on the loop, the usual case) the interval changes nothing."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (0: a port the system picks), bound before the
    banner is printed so the banner can name the port; connections made before the server
    runs wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # a TCP socket by name: asyncio sets TCP_NODELAY only on connections of one (unnamed,
    # Nagle met the client's delayed ACK and each response waited ~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise CliError(f"cannot listen on {host}:{port}: {reason}", EXIT_FAILED) from None
    sock.set_inheritable(True)
    return sock


def _say(log_json: bool, event: str, text: str, *, warning: bool = False, **fields: Any) -> None:
    """One line on stderr: ``text`` for a reader, or under ``--log-json`` the ``event`` with
    ``fields`` (every line of a JSON log is JSON)."""
    if log_json:
        log = get_logger()
        (log.warning if warning else log.info)(event, **fields)
    else:
        flush_held_lines()
        print(f"{_PREFIX}: {'warning: ' if warning else ''}{text}", file=sys.stderr)


def _check_store(states: SessionStates, log_json: bool = False) -> None:
    """One listing of the shared store at start: a warning when it does not answer (the proxy
    serves all the same: results are sent whole until it does)."""
    try:
        states.check()
    except OSError as exc:
        _say(
            log_json,
            "store.unanswered",
            f"store {terminal_safe(states.location)} does not answer now ({exc.strerror}); "
            "serving anyway: results are sent whole until it does",
            warning=True,
            store=states.location,
            error=exc.strerror or type(exc).__name__,
        )


def retention(
    args: argparse.Namespace, root: Path
) -> list[Callable[[], Coroutine[Any, Any, object]]]:
    """With ``--retain`` or ``--max-store-size``: prune the store now (before the server
    starts, reported on stderr), and return the task that prunes it every
    :data:`PRUNE_INTERVAL` seconds while the proxy runs. Without them: nothing, no task."""
    max_age, max_bytes = args.retain, args.max_store_size
    if max_age is None and max_bytes is None:
        return []
    if root.exists() and not root.is_dir():
        raise CliError(f"--store {root}: not a directory")
    try:
        report = prune_store(root, max_age=max_age, max_bytes=max_bytes)
    except OSError as exc:
        raise CliError(f"--store {root}: cannot prune: {exc.strerror or exc}") from None
    log_json = bool(getattr(args, "log_json", False))
    _report(report, log_json, always=True)
    periodic = functools.partial(
        prune_periodically,
        root,
        interval=PRUNE_INTERVAL,
        max_age=max_age,
        max_bytes=max_bytes,
        on_report=functools.partial(_report, log_json=log_json),
        on_error=functools.partial(_prune_failed, log_json=log_json),
    )
    return [periodic]


def _report(report: PruneReport, log_json: bool = False, *, always: bool = False) -> None:
    # the periodic prunes speak only when they did something
    if always or report.removed or report.errors:
        summary = report.to_json()
        for detail in ("files", "removed_dirs", "errors"):  # one line, not one per file
            summary.pop(detail)
        where = terminal_safe(str(report.root))
        _say(log_json, "store.pruned", f"store {where}: {describe(report)}", **summary)
    if not log_json:
        warn_errors(report, _PREFIX)
        return
    for path, error in report.errors:
        get_logger().warning("store.not_pruned", path=str(path), error=error)


def _prune_failed(exc: Exception, log_json: bool = False) -> None:
    shown = terminal_safe(str(exc), limit=500)
    _say(
        log_json,
        "store.prune_failed",
        f"store prune failed: {shown}",
        warning=True,
        error=type(exc).__name__,
    )
