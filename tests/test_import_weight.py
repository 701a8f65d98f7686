"""The proxy and the replay never import the anthropic SDK (~0.8 s and ~60 MB resident at
import): only a wrapped client and the live agent need it. Each command runs as users run it,
with Python's import-time report on stderr (``PYTHONPROFILEIMPORTTIME``), which lists every
module the process imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest

from pipeline.testing import Reply, ScriptedMessagesServer
from tests.wire_support import clean_env, proxy_process

REPO = Path(__file__).resolve().parent.parent


def _imported(lines: list[str]) -> set[str]:
    """The modules an import-time report names (``import time: self | cumulative | name``)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in lines
        if line.startswith("import time:") and line.count("|") == 2
    }


def _ok(_body: dict[str, Any]) -> Reply:
    return Reply([{"type": "text", "text": "ok"}])


def test_the_proxy_serves_without_the_sdk(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn", reason="the proxy extra is not installed")
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with (
        ScriptedMessagesServer(_ok) as upstream,
        proxy_process(upstream.base_url, tmp_path, PYTHONPROFILEIMPORTTIME="1") as (
            url,
            lines,
            _,
        ),
    ):
        answer = httpx2.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "k"})
        assert answer.status_code == 200, answer.text
    imported = _imported(lines)
    assert "pipeline.dropin.proxy" in imported  # the report is there
    assert "anthropic" not in imported


def test_the_replay_runs_without_the_sdk(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    records = [
        {"type": "user", "uuid": "u1", "message": {"role": "user", "content": "hi"}},
        {
            "type": "assistant",
            "uuid": "a1",
            "parentUuid": "u1",
            "message": {
                "role": "assistant",
                "content": [{"type": "text", "text": "hello"}],
                "usage": {"input_tokens": 3, "output_tokens": 2},
            },
        },
    ]
    session.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = clean_env(PYTHONPROFILEIMPORTTIME="1")
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "replay", str(session), "--json"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = _imported(done.stderr.splitlines())
    assert "pipeline.transcript.replay" in imported
    assert "anthropic" not in imported


def test_wrap_is_the_function_however_it_was_imported() -> None:
    code = (
        "import sys, pipeline.dropin.wrap, stages, pipeline.dropin as d\n"
        "from pipeline.dropin import wrap\n"
        "from pipeline.dropin.wrap import SluicegateMiddleware\n"
        "import anthropic\n"
        "assert callable(wrap) and d.wrap is wrap is sys.modules['pipeline.dropin.wrap'].wrap\n"
        "assert issubclass(SluicegateMiddleware, anthropic.Middleware)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
