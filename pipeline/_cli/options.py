"""The options and help texts the ``sluicegate`` commands share (see :mod:`.parser`)."""

from __future__ import annotations

import argparse
import textwrap

from pipeline._cli.arg_types import (
    nonempty_path,
    positive_int,
    store_cool_down,
    store_location,
    store_retries,
    store_timeout,
)
from pipeline.policies import DEFAULT_MAX_RESULT_SIZE_CHARS, MAX_TOOL_RESULTS_PER_MESSAGE_CHARS
from pipeline.store.files import STORE_COOL_DOWN
from pipeline.store.sessions import STORE_RETRIES, STORE_TIMEOUT

STORE_HELP = (
    "directory for persisted results (<DIR>/<session>/tool-results/); never removed by the "
    "command. Default: a new temporary directory, removed when the command ends (done, failed "
    "or interrupted with Ctrl-C) unless --keep-store"
)
KEEP_STORE_HELP = (
    "keep the temporary store made when no --store is given (for the demo, its transcript "
    "too): its location is printed in the summary (and in the JSON summary's 'store', with "
    "'store_kept': true). Delete it when done. Has no effect with --store"
)
LONG_LIVED_STORE_HELP = "directory for persisted results (<DIR>/<session>/tool-results/)"
PROXY_STORE_HELP = (
    "where the sessions' persisted results and decisions live: a directory "
    "(<DIR>/<session>/...), or s3://BUCKET/PREFIX (az://CONTAINER/PREFIX on Azure) shared by "
    "every proxy given the same URL (a fleet; the objectstore extra). Default .sluicegate"
)
AGENT_STORE_HELP = (
    "directory for the session (<DIR>/<session>/transcript.jsonl and tool-results/), or "
    "s3://BUCKET/PREFIX or az://CONTAINER/PREFIX for the persisted results (the objectstore "
    "extra; the transcript and "
    "the token calibration stay in .sluicegate, or beside the --resume transcript)"
)
TRACING_EPILOG = """\
tracing:
  Spans are exported over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT or
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (service.name "sluicegate" unless
  OTEL_SERVICE_NAME is set); nothing is exported otherwise. The protocol comes from
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf
  (default; pip install 'sluicegate[otel]') or grpc (pip install
  'sluicegate[otel-grpc]'). Spans never hold message content.

exit codes: 0 ok, 1 the command failed part-way (a stage stopped the session, an
  output could not be written), 2 bad usage or bad input, 130 interrupted (Ctrl-C),
  143 terminated (SIGTERM); a temporary store (replay's, demo's) is removed either way.
"""


def para(text: str) -> str:
    # the raw formatter keeps the epilog's layout; descriptions are wrapped here instead
    return textwrap.fill(text, width=79)


def add_object_store_options(p: argparse.ArgumentParser) -> None:
    """``--store-timeout`` and ``--store-retries``: how long a call may wait on an
    ``s3://`` store."""
    group = p.add_argument_group(
        "object store",
        "With --store s3://BUCKET/PREFIX: credentials, region and endpoint come from the usual "
        "AWS environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, "
        "AWS_REGION, AWS_ENDPOINT_URL, AWS_ALLOW_HTTP...; AWS_TIMEOUT and AWS_CONNECT_TIMEOUT "
        "too, below the flags here); with az://CONTAINER/PREFIX from the AZURE_STORAGE_* ones "
        "(AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY...). A store that fails never "
        "fails a call.",
    )
    group.add_argument(
        "--store-timeout",
        type=store_timeout,
        metavar="SECONDS",
        help=f"how long one store request may take (default {STORE_TIMEOUT:g})",
    )
    group.add_argument(
        "--store-retries",
        type=store_retries,
        metavar="N",
        help=f"retries of a failed store request, 0-10 (default {STORE_RETRIES})",
    )
    group.add_argument(
        "--store-cool-down",
        type=store_cool_down,
        metavar="SECONDS",
        help="after a store request has failed, how long the store is not asked again (each "
        "call goes on without it at once; then one call probes it); 0 asks it every call "
        f"(default {STORE_COOL_DOWN:g})",
    )


def add_replay_options(
    p: argparse.ArgumentParser,
    *,
    temporary_store: bool,
    store_help: str | None = None,
    per_call_output: bool = True,
) -> None:
    """The options every pipeline command takes; ``temporary_store``: the command makes a
    temporary store when no ``--store`` is given (and so takes ``--keep-store``);
    ``store_help``: the command's ``--store`` also takes an object store URL, as this says;
    ``per_call_output=False``: a server (the proxy), which prints no table, JSON lines,
    request dumps or progress bar."""
    budget = p.add_argument_group("budget")
    budget.add_argument(
        "--per-message-chars",
        type=positive_int,
        default=MAX_TOOL_RESULTS_PER_MESSAGE_CHARS,
        metavar="N",
        help="per-message budget: tool_result chars in one API-level user message "
        "(default %(default)s)",
    )
    budget.add_argument(
        "--per-tool-chars",
        type=positive_int,
        default=DEFAULT_MAX_RESULT_SIZE_CHARS,
        metavar="N",
        help="per-tool cap (default %(default)s); Claude Code's declared limits below it still "
        "apply (Bash 30000, Grep 20000, ...) and Read is never persisted",
    )
    if store_help is not None:
        budget.add_argument("--store", type=store_location, metavar="DIR|URL", help=store_help)
    else:
        help_text = STORE_HELP if temporary_store else LONG_LIVED_STORE_HELP
        budget.add_argument("--store", type=nonempty_path, metavar="DIR", help=help_text)
    if temporary_store:
        budget.add_argument("--keep-store", action="store_true", help=KEEP_STORE_HELP)
    budget.add_argument(
        "--stage",
        action="append",
        metavar="SLOT=STRATEGY[:k=v...]",
        help="choose a strategy for a stage slot, e.g. microcompact=clear-oldest:keep=5 or "
        "history_snip=off (repeatable)",
    )

    out = p.add_argument_group("output")
    if per_call_output:
        _add_per_call_output(out)
    out.add_argument("--console-spans", action="store_true", help="also print every span to stderr")
    out.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log to stderr at INFO (-v) or DEBUG (-vv); default WARNING",
    )
    out.add_argument(
        "--log-json", action="store_true", help="log JSON lines instead of readable text"
    )


def _add_per_call_output(out: argparse._ArgumentGroup) -> None:
    out.add_argument(
        "--json",
        action="store_true",
        help='one JSON object per call on stdout, then a final {"summary": {...}} line '
        "(default: an aligned table)",
    )
    out.add_argument(
        "--dump-requests",
        type=nonempty_path,
        metavar="DIR",
        help="write DIR/NNNN.json: the exact 'messages' array sent for call NNNN (DIR must "
        "hold no NNNN.json from an earlier run)",
    )
    out.add_argument(
        "--dump-calls",
        metavar="N,N-M,...",
        help="with --dump-requests: only these calls (e.g. 0,10-20)",
    )
    out.add_argument(
        "--dump-format",
        choices=("full", "delta"),
        default="full",
        help="with --dump-requests: 'full' (each file the whole array, the default) or 'delta' "
        '(each file {"call", "prefix", "messages"}: the first PREFIX messages of the previous '
        "dumped request, then these)",
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
