"""Running the command line in tests: a subprocess with a clean environment, and its
``--json`` output read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CALL_KEYS = {
    "call",
    "message_id",
    "estimated_tokens",
    "actual_tokens",
    "persisted",
    "reapplied",
    "request_chars",
}


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any OTel settings of the caller, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra)
    return env


def run_cli(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m pipeline ARGS`` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env if env is not None else clean_env(),
        timeout=120,
        check=False,
    )


def parse_json_lines(stdout: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-call objects and the summary of a ``--json`` run."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert lines, "no JSON output"
    assert set(lines[-1]) == {"summary"}, lines[-1]
    calls = lines[:-1]
    assert all("summary" not in c for c in calls)
    return calls, lines[-1]["summary"]
