"""The command line: ``python -m pipeline replay|demo`` against its contract (docs/behaviour.md).

Most tests run the CLI as a subprocess (the real entry point, real stdout/stderr separation);
a few call ``main([...])`` in-process. The trace test exports over real OTLP/HTTP to a local
receiver and checks the span tree it decodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from anthropic.types import MessageParam

from pipeline import Pipeline, SessionContext, ToolPolicies, load_transcript
from pipeline._cli.app import main
from pipeline._cli.common import session_id_for
from pipeline._cli.demo_session import OUTPUT_MARKER, generate_session, write_session
from pipeline._cli.report import ReplaySummary
from pipeline.transcript.replay import find_calls, replay_messages, request_chars
from pipeline.wire.pairing import check_pairing
from stages import default_stages
from tests.cli_support import CALL_KEYS, clean_env, parse_json_lines, run_cli
from tests.conftest import corpus_sessions
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

PERSISTED_KEYS = {"tool_use_id", "chars", "path"}
SUMMARY_KEYS = {
    "session_id",
    "calls",
    "persisted",
    "persisted_chars",
    "reapplied",
    "persist_failed",
    "peak_request_chars",
    "pairing_problems",
    "calls_with_pairing_problems",
    "calls_with_actual_tokens",
    "abs_rel_error_median",
    "abs_rel_error_p95",
    "undercount_gt_10pct_share",
    "estimated_part",
    "request_tokens",
    "transcript",
    "per_message_chars",
    "per_tool_chars",
    "store",
    "store_kept",
}
STAGE_NAMES = [
    "tool_result_budget",
    "history_snip",
    "microcompact",
    "context_collapse",
    "autocompact",
]


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``main([...])`` in-process (no interpreter start-up): exit code, stdout, stderr."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``demo --json --dump-requests`` run shared by the tests that only read its output."""
    base = tmp_path_factory.mktemp("demo")
    store, dumps, transcript = base / "store", base / "requests", base / "session.jsonl"
    proc = run_cli(
        "demo",
        "--replay",
        "--json",
        "--store",
        store,
        "--dump-requests",
        dumps,
        "--out",
        transcript,
    )
    assert proc.returncode == 0, proc.stderr
    calls, summary = parse_json_lines(proc.stdout)
    return {
        "calls": calls,
        "summary": summary,
        "store": store,
        "dumps": dumps,
        "transcript": transcript,
        "stderr": proc.stderr,
    }


def _tool_results(request: list[dict[str, Any]]) -> dict[str, Any]:
    """tool_use_id -> content of every tool_result in a wire request."""
    out: dict[str, Any] = {}
    for param in request:
        content = param["content"]
        if isinstance(content, list):
            for b in content:
                if b.get("type") == "tool_result":
                    out[b["tool_use_id"]] = b.get("content")
    return out


def _tool_names(request: list[dict[str, Any]]) -> dict[str, str]:
    return {
        b["id"]: b["name"]
        for param in request
        if isinstance(param["content"], list)
        for b in param["content"]
        if b.get("type") == "tool_use"
    }


def _load_dump(dumps: Path, number: int) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads((dumps / f"{number:04d}.json").read_text("utf-8"))
    return data


# ---------------------------------------------------------------------------------------------
# demo + the --json contract
# ---------------------------------------------------------------------------------------------


def test_json_lines_follow_the_contract_exactly(demo_run: dict[str, Any]) -> None:
    calls, summary = demo_run["calls"], demo_run["summary"]
    session = generate_session()
    expected_ids = [c.message_id for c in find_calls(session.messages)]
    assert [c["message_id"] for c in calls] == expected_ids
    assert [c["call"] for c in calls] == list(range(len(expected_ids)))
    for c in calls:
        assert set(c) == CALL_KEYS
        assert isinstance(c["estimated_tokens"], int) and c["estimated_tokens"] > 0
        assert isinstance(c["actual_tokens"], int) and c["actual_tokens"] > 0
        assert isinstance(c["reapplied"], int)
        assert isinstance(c["request_chars"], int) and c["request_chars"] > 0
        for p in c["persisted"]:
            assert set(p) == PERSISTED_KEYS
            assert isinstance(p["chars"], int) and p["chars"] > 0
    assert set(summary) == SUMMARY_KEYS
    assert summary["session_id"] == session.session_id
    assert summary["calls"] == len(calls)
    assert summary["persisted"] == sum(len(c["persisted"]) for c in calls)
    assert summary["persisted_chars"] == sum(p["chars"] for c in calls for p in c["persisted"])
    assert summary["reapplied"] == sum(c["reapplied"] for c in calls)
    assert summary["peak_request_chars"] == max(c["request_chars"] for c in calls)
    assert summary["calls_with_actual_tokens"] == len(calls)
    assert summary["persist_failed"] == 0
    assert Path(summary["store"]) == demo_run["store"]


def test_demo_persists_and_the_next_call_reapplies_byte_for_byte(demo_run: dict[str, Any]) -> None:
    calls, dumps = demo_run["calls"], demo_run["dumps"]
    # the ten parallel ~40K logs (400K) break the 200K per-message budget at call 1
    assert len(calls[0]["persisted"]) == 0
    first = calls[1]["persisted"]
    assert len(first) >= 4
    cumulative = 0
    for n, c in enumerate(calls[:-1]):
        cumulative += len(c["persisted"])
        assert calls[n + 1]["reapplied"] == cumulative, f"call {n + 1}"

    request1, request2 = _load_dump(dumps, 1), _load_dump(dumps, 2)
    sent1, sent2 = _tool_results(request1), _tool_results(request2)
    session = generate_session()
    original = {
        b["tool_use_id"]: b["content"]
        for m in session.messages
        if m.type == "user" and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    }
    for p in first:
        tid = p["tool_use_id"]
        assert sent1[tid].startswith("<persisted-output>\n")
        assert p["path"] in sent1[tid]
        assert sent2[tid] == sent1[tid]  # re-applied: the cached prefix does not move
        # nothing lost: the stored file holds the original output (a text-block list as JSON)
        stored = json.loads(Path(p["path"]).read_text("utf-8"))
        assert stored == original[tid]
        assert p["chars"] == sum(len(b["text"]) for b in original[tid])
    # what stayed visible in that user message fits the budget
    visible = sum(len(v[0]["text"]) for k, v in sent1.items() if isinstance(v, list))
    assert visible <= 200_000
    assert visible + sum(p["chars"] for p in first) > 200_000


def test_read_is_never_persisted_and_bash_over_its_declared_limit_is(
    demo_run: dict[str, Any],
) -> None:
    calls, dumps = demo_run["calls"], demo_run["dumps"]
    last = _load_dump(dumps, len(calls) - 1)
    names = _tool_names(last)
    persisted = {p["tool_use_id"]: p for c in calls for p in c["persisted"]}
    read_ids = [tid for tid, name in names.items() if name == "Read"]
    assert read_ids
    for tid in read_ids:
        assert tid not in persisted
        content = _tool_results(last)[tid]
        assert isinstance(content, str) and len(content) > 50_000  # sent whole, over the cap
    bash_persisted = [p for tid, p in persisted.items() if names[tid] == "Bash"]
    assert len(bash_persisted) == 1 and bash_persisted[0]["chars"] > 30_000


def test_dump_requests_are_the_requests_and_are_paired(
    demo_run: dict[str, Any], tmp_path: Path
) -> None:
    dumps = demo_run["dumps"]
    names = sorted(p.name for p in dumps.iterdir())
    assert names == [f"{n:04d}.json" for n in range(len(demo_run["calls"]))]

    # the same replay done with the library directly, on the same store, gives the same bytes
    transcript = load_transcript(demo_run["transcript"])

    async def replay() -> list[list[MessageParam]]:
        ctx = SessionContext(
            session_id_for(transcript),
            root=demo_run["store"],
            tool_policies=ToolPolicies.claude_code(),
        )
        pipe = Pipeline(default_stages())
        return [r.request async for r in replay_messages(transcript.messages, pipe, ctx)]

    expected = anyio.run(replay)
    assert len(expected) == len(names)
    for n, request in enumerate(expected):
        dumped = _load_dump(dumps, n)
        assert dumped == request
        assert check_pairing(dumped) == []
    # and each dump is what its JSON line says it was
    for line, request in zip(demo_run["calls"], expected, strict=True):
        assert line["request_chars"] == request_chars(request)


def test_smaller_limits_persist_more(
    demo_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(
        capsys,
        "demo",
        "--replay",
        "--json",
        "--store",
        tmp_path,
        "--per-message-chars",
        "20000",
        "--per-tool-chars",
        "8000",
    )
    assert code == 0, err
    calls, summary = parse_json_lines(out)
    assert summary["persisted"] > demo_run["summary"]["persisted"]
    assert summary["per_message_chars"] == 20_000 and summary["per_tool_chars"] == 8_000
    # every log (~40K) is now over the 8K cap; Read still is never persisted
    assert len(calls[1]["persisted"]) == 10
    persisted_ids = {p["tool_use_id"] for c in calls for p in c["persisted"]}
    last = _load_dump(demo_run["dumps"], len(calls) - 1)
    read_ids = {tid for tid, name in _tool_names(last).items() if name == "Read"}
    assert read_ids and not (read_ids & persisted_ids)


def test_demo_table_is_short_and_names_what_was_persisted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(capsys, "demo", "--replay", "--store", tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) < 40
    header = next(line for line in lines if line.split()[:2] == ["call", "message_id"])
    assert "req.chars" in header
    session = generate_session()
    for call in find_calls(session.messages):
        assert any(call.message_id in line for line in lines)
    persisted_lines = [line for line in lines if "+ persisted" in line]
    assert len(persisted_lines) == len(
        list((tmp_path / session.session_id / "tool-results").iterdir())
    )
    assert str(tmp_path / session.session_id / "tool-results") in out
    assert "re-applied" in out
    assert err == ""  # WARNING level by default: nothing to say; no progress off a TTY


def test_demo_transcript_is_deterministic(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_session(a)
    write_session(b)
    write_session(c, seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    loaded = load_transcript(a)
    assert loaded.session_id == generate_session().session_id
    # Claude Code's streaming shape: one record per block, several records per response id
    ids = Counter(m.message_id for m in loaded.messages if m.type == "assistant")
    assert max(ids.values()) >= 10
    assert any(m.type == "progress" for m in loaded.messages)
    assert all(
        len(m.content) == 1
        for m in loaded.messages
        if m.type == "user" and isinstance(m.content, list)
    )


def test_main_in_process_demo_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "s.jsonl"
    assert main(["demo", "--replay", "--json", "--store", str(tmp_path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    calls, summary = parse_json_lines(captured.out)
    assert summary["persisted"] == sum(len(c["persisted"]) for c in calls) > 0
    assert out.is_file()
    # replay of the written file through the other subcommand gives the same lines
    assert main(["replay", str(out), "--json", "--store", str(tmp_path)]) == 0
    again, summary2 = parse_json_lines(capsys.readouterr().out)
    assert again == calls
    assert summary2 == summary


# ---------------------------------------------------------------------------------------------
# progress, logging
# ---------------------------------------------------------------------------------------------


def test_progress_goes_to_stderr_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(
        capsys, "demo", "--replay", "--json", "--progress", "--store", tmp_path
    )
    assert code == 0, err
    assert "replaying [" in err and "5/5 calls" in err
    assert "replaying" not in out
    parse_json_lines(out)  # stdout is still pure JSON lines


def test_verbose_json_logs_carry_decisions_but_no_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_main(capsys, "demo", "--json", "-v", "--log-json", "--store", tmp_path)
    assert code == 0, err
    events = [json.loads(line) for line in err.splitlines() if line.strip()]
    decisions = [e for e in events if e["event"] == "tool_result_budget.decision"]
    assert {e["decision"] for e in decisions} >= {"persist"}
    assert all(e["level"] in ("info", "warning", "error") for e in events)
    assert OUTPUT_MARKER not in err
    assert OUTPUT_MARKER not in out


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def _write_malformed(path: Path) -> int:
    """A demo transcript with line 5 broken; returns the broken line's number."""
    write_session(path)
    lines = path.read_text("utf-8").splitlines(keepends=True)
    lines[4] = lines[4][: len(lines[4]) // 2] + "\n"
    path.write_text("".join(lines), "utf-8")
    return 5


def test_malformed_line_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    line = _write_malformed(bad)
    proc = run_cli("replay", bad, "--json", "--store", tmp_path / "store")
    assert proc.returncode == 2
    assert f"{bad}:{line}:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


def test_lenient_skips_and_reports_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    line = _write_malformed(bad)
    code, out, err = run_main(
        capsys, "replay", bad, "--lenient", "--json", "--store", tmp_path / "store"
    )
    assert code == 0, err
    assert f"skipped {bad}:{line}:" in err
    calls, summary = parse_json_lines(out)
    assert summary["calls"] == len(calls) > 0


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    code, out, err = run_main(capsys, "replay", missing)
    assert code == 2
    assert err == f"sluicegate: error: {missing}: no such file\n"
    assert out == ""


def test_bad_option_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--per-tool-chars", "0"])
    assert exc.value.code == 2
    assert "--per-tool-chars" in capsys.readouterr().err


def test_session_id_falls_back_to_the_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src.jsonl"
    write_session(src)
    stripped = tmp_path / "my session!.jsonl"
    with src.open(encoding="utf-8") as fh, stripped.open("w", encoding="utf-8") as dst:
        for line in fh:
            record = json.loads(line)
            record.pop("sessionId", None)
            dst.write(json.dumps(record, ensure_ascii=False) + "\n")
    code, out, err = run_main(capsys, "replay", stripped, "--json", "--store", tmp_path / "store")
    assert code == 0, err
    calls, summary = parse_json_lines(out)
    assert summary["session_id"] == "my_session_"
    paths = [Path(p["path"]) for c in calls for p in c["persisted"]]
    assert paths and all(
        p.parent == tmp_path / "store" / "my_session_" / "tool-results" for p in paths
    )


# ---------------------------------------------------------------------------------------------
# help and entry points
# ---------------------------------------------------------------------------------------------


def test_help_lists_commands_and_every_replay_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    top = capsys.readouterr().out
    assert "replay" in top and "demo" in top
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    replay_help = capsys.readouterr().out
    for option in (
        "--per-message-chars",
        "--per-tool-chars",
        "--store",
        "--json",
        "--dump-requests",
        "--progress",
        "--console-spans",
        "--lenient",
        "--verbose",
        "--log-json",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "sluicegate[otel]",
    ):
        assert option in replay_help, option
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    demo_help = capsys.readouterr().out
    assert "--out" in demo_help and "--seed" in demo_help and "--per-tool-chars" in demo_help


def test_console_script_runs() -> None:
    script = Path(sys.executable).parent / "sluicegate"
    if not script.exists():
        pytest.skip("the sluicegate console script is not installed in this environment")
    proc = subprocess.run(
        [str(script), "demo", "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: sluicegate demo")


# ---------------------------------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------------------------------


def _small_corpus_file() -> Path | None:
    files = [f for f in corpus_sessions() if f.stat().st_size < 300_000]
    for f in sorted(files, key=lambda f: f.stat().st_size):
        if len(find_calls(load_transcript(f).messages)) >= 3:
            return f
    return None


@pytest.mark.corpus
def test_corpus_replay_of_a_small_session(tmp_path: Path) -> None:
    path = _small_corpus_file()
    if path is None:
        pytest.skip("no corpus (or no small session in it)")
    transcript = load_transcript(path)
    expected = find_calls(transcript.messages)
    proc = run_cli("replay", path, "--json", "--store", tmp_path, "--dump-requests", tmp_path / "d")
    assert proc.returncode == 0, proc.stderr
    calls, summary = parse_json_lines(proc.stdout)
    assert [c["message_id"] for c in calls] == [c.message_id for c in expected]
    assert [c["actual_tokens"] for c in calls] == [
        c.usage.input_side if c.usage else None for c in expected
    ]
    assert summary["calls_with_actual_tokens"] == sum(1 for c in expected if c.usage is not None)
    assert summary["session_id"] == transcript.session_id
    assert summary["abs_rel_error_median"] is not None and summary["abs_rel_error_median"] >= 0
    assert len(list((tmp_path / "d").iterdir())) == len(expected)


# ---------------------------------------------------------------------------------------------
# the summary statistics
# ---------------------------------------------------------------------------------------------


def test_estimate_error_statistics() -> None:
    s = ReplaySummary("s", Path("."), 1, 1)
    # relative errors: -0.5, -0.2, -0.05, 0.0, +0.1 ... +0.9 (10 values)
    s.relative_errors = array("d", [-0.5, -0.2, -0.05, 0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9])
    assert s.median_abs_error == pytest.approx((0.3 + 0.5) / 2)
    assert s.p95_abs_error == pytest.approx(0.9)  # nearest rank: ceil(9.5) = 10th of 10
    assert s.undercount_share == pytest.approx(0.2)  # -0.5 and -0.2; -0.05 is within 10%
    assert ReplaySummary("s", Path("."), 1, 1).to_json()["abs_rel_error_median"] is None


# ---------------------------------------------------------------------------------------------
# tracing: real OTLP/HTTP export
# ---------------------------------------------------------------------------------------------


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [
        s for s in spans if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id
    ]


def test_spans_exported_over_otlp_form_the_documented_tree(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        env = clean_env(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=rx.traces_endpoint)
        proc = run_cli("demo", "--replay", "--json", "--store", tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        calls, summary = parse_json_lines(proc.stdout)
        # the CLI shuts the provider down before exiting, so everything has arrived
        spans = rx.spans
        assert rx.bad_paths == []
    assert spans, "no spans received"

    runs = [s for s in spans if s.name == "pipeline.run"]
    assert len(runs) == len(calls)
    by_id = {s.span_id: s for s in spans}
    (replay,) = [s for s in spans if s.name == "replay.session"]
    assert replay.parent_span_id == ""  # the session's own trace, with the totals
    assert replay.attributes["sluicegate.calls"] == len(calls)
    assert replay.attributes["sluicegate.persisted"] == summary["persisted"]
    traces = set()
    for number, run in enumerate(runs):
        call = by_id[run.parent_span_id]  # a trace per call, its root linked to the session
        assert call.name == "replay.call" and call.parent_span_id == ""
        assert call.links == (replay.span_id,)
        traces.add(call.trace_id)
        in_call = [s for s in spans if s.trace_id == call.trace_id]
        assert {s.attributes["sluicegate.call"] for s in in_call} == {number}
        assert run.attributes["gen_ai.conversation.id"] == summary["session_id"]
        assert "gen_ai.operation.name" not in run.attributes
        stage_spans = _children(spans, run)
        assert [s.name for s in stage_spans] == [f"stage.{n}" for n in STAGE_NAMES]
        for s in stage_spans:
            assert s.attributes["gen_ai.conversation.id"] == summary["session_id"]

    decisions = [
        s
        for s in spans
        if s.name == f"tool_result_budget.{s.attributes.get('sluicegate.decision')}"
    ]
    assert decisions
    for d in decisions:
        if "gen_ai.tool.call.id" not in d.attributes:  # a pass with nothing fresh to decide
            assert d.attributes["sluicegate.reason"] == "no_fresh_results"
            assert by_id[d.parent_span_id].name == "stage.tool_result_budget"
            continue
        group = by_id[d.parent_span_id]
        assert group.name == "tool_result_budget.group"
        stage = by_id[group.parent_span_id]
        assert stage.name == "stage.tool_result_budget"
        assert by_id[stage.parent_span_id].name == "pipeline.run"
    persist_ids = {
        d.attributes.get("gen_ai.tool.call.id")
        for d in decisions
        if d.attributes["sluicegate.decision"] == "persist"
    }
    assert persist_ids == {p["tool_use_id"] for c in calls for p in c["persisted"]}
    reads = [d for d in decisions if d.attributes.get("gen_ai.tool.name") == "Read"]
    assert reads and all(
        d.attributes["sluicegate.decision"] == "skip_unbounded_tool" for d in reads
    )

    assert {s.resource.get("service.name") for s in spans} == {"sluicegate"}
    assert {s.scope for s in spans} == {"sluicegate"}
    # no tool output text in any span attribute, ever
    for s in spans:
        for key, value in s.attributes.items():
            assert OUTPUT_MARKER not in str(value), (s.name, key)


def _unset_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


def test_base_endpoint_and_service_name_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_otel_env(monkeypatch)
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "budget-lab")
        code, _, err = run_main(capsys, "demo", "--json", "--store", tmp_path)
        assert code == 0, err
        spans = rx.spans
    assert sum(1 for s in spans if s.name == "pipeline.run") == 5
    assert {s.resource.get("service.name") for s in spans} == {"budget-lab"}


def test_nothing_exported_without_the_env_var(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_otel_env(monkeypatch)
    with OtlpReceiver() as rx:
        # the receiver listens, but nobody told the CLI about it
        code, _, err = run_main(capsys, "demo", "--json", "--store", tmp_path)
        assert code == 0, err
        assert rx.requests == 0 and rx.spans == []


def test_console_spans_go_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_otel_env(monkeypatch)
    code, out, err = run_main(capsys, "demo", "--json", "--console-spans", "--store", tmp_path)
    assert code == 0, err
    assert err.count('"name": "pipeline.run"') == 5
    assert '"sluicegate.decision": "persist"' in err
    parse_json_lines(out)
    assert OUTPUT_MARKER not in err


@pytest.mark.parametrize(
    "blocked",
    ["opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"],
)
def test_missing_sdk_gives_an_install_hint(
    blocked: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _unset_otel_env(monkeypatch)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, blocked, None)  # a None entry makes the import fail
    code, out, err = run_main(capsys, "demo", "--json", "--store", tmp_path)
    assert code == 2
    assert "pip install 'sluicegate[otel]'" in err
    assert len(err.strip().splitlines()) == 1
    assert out == ""
    assert not (tmp_path / "demo-session.jsonl").exists()  # failed before doing any work


def test_the_command_says_its_version() -> None:
    import importlib.metadata

    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"sluicegate {importlib.metadata.version('sluicegate')}"


@pytest.mark.parametrize("flag", ["--json", "--progress", "--dump-requests"])
def test_the_proxy_takes_no_flag_it_would_ignore(flag: str, tmp_path: Path) -> None:
    """A server prints no table, JSON lines, request dumps or progress bar: such a flag is
    refused, never silently ignored."""
    assert flag not in run_cli("proxy", "--help").stdout
    proc = run_cli(
        "proxy", "--store", tmp_path, flag, *(["x"] if flag == "--dump-requests" else [])
    )
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


def test_every_option_of_every_command_says_what_it_does() -> None:
    import argparse

    from pipeline._cli.parser import build_parser

    silent: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                silent.append(f"{name} {action.option_strings or action.dest}")

    walk(build_parser(), "sluicegate")
    assert silent == []
