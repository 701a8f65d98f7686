"""Choosing strategies from config strings, and comparing pipelines under the cache model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeline import Message, Pipeline, SessionContext, Usage, stage
from pipeline._cli.compare import (
    PRICES,
    CacheModel,
    Price,
    compare_pipelines,
    load_prices,
    price_for,
)
from stages import Microcompact, ServerSideMicrocompact, ToolResultBudget
from stages._shared import CLEARED_PLACEHOLDER as CLEARED
from stages.baselines import ClearEveryTurn, HeadTailTruncate
from stages.registry import build_pipeline, build_stage, comparison_pipeline, parse_stage_spec
from tests.builders import results, tool_result, tool_use
from tests.cli_support import run_cli

# -- config -----------------------------------------------------------------------------------


def test_parse_stage_spec() -> None:
    assert parse_stage_spec("microcompact=clear-oldest:keep=5") == (
        "microcompact",
        "clear-oldest",
        {"keep": 5},
    )
    slot, strategy, kwargs = parse_stage_spec(
        "microcompact=server-clear:trigger_tokens=80_000:clear_tool_inputs=true:exclude_tools=Read+Grep"
    )
    assert (slot, strategy) == ("microcompact", "server-clear")
    assert kwargs == {
        "trigger_tokens": 80_000,
        "clear_tool_inputs": True,
        "exclude_tools": ("Read", "Grep"),
    }
    for bad in ("microcompact", "=x", "microcompact=clear-oldest:keep"):
        with pytest.raises(ValueError, match="stage spec"):
            parse_stage_spec(bad)


def test_build_pipeline_from_a_config_mapping() -> None:
    pipe = build_pipeline(
        {
            "microcompact": {"strategy": "server-clear", "keep": 3},
            "history_snip": "off",
            "tool_result_budget": "budget:limit=50000",
        }
    )
    assert pipe.names == ["tool_result_budget", "microcompact", "context_collapse", "autocompact"]
    mc = pipe["microcompact"]
    assert isinstance(mc, ServerSideMicrocompact)
    budget = pipe["tool_result_budget"]
    assert isinstance(budget, ToolResultBudget) and budget.limit == 50_000
    assert isinstance(build_pipeline()["microcompact"], Microcompact)


@pytest.mark.parametrize(
    ("slot", "strategy", "kwargs", "message"),
    [
        ("nope", "x", {}, "unknown stage slot 'nope'"),
        ("microcompact", "magic", {}, "unknown strategy 'magic' for microcompact"),
        ("microcompact", "clear-oldest", {"colour": 1}, "microcompact=clear-oldest"),
    ],
)
def test_bad_config_names_what_is_wrong(
    slot: str, strategy: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_stage(slot, strategy, **kwargs)


def test_comparison_points() -> None:
    assert comparison_pipeline("none").names == []
    assert comparison_pipeline("truncate").names == ["truncate"]
    assert comparison_pipeline("clear-every-turn").names == ["microcompact"]
    assert len(comparison_pipeline("default")) == 5
    with pytest.raises(ValueError, match="unknown comparison point"):
        comparison_pipeline("fastest")


@pytest.mark.asyncio
async def test_baselines(tmp_path: Path) -> None:
    ctx = SessionContext("b", tmp_path)
    long = "h" * 6_000 + "m" * 3_000 + "t" * 6_000
    msgs = [Message.assistant([tool_use("a")], message_id="r"), results(tool_result("a", long))]
    out = await HeadTailTruncate(10_000)(msgs, ctx)
    assert (
        out[1].content[0]["content"]
        == "h" * 5_000 + "\n[... 5000 characters truncated ...]\n" + "t" * 5_000
    )  # type: ignore[index]
    short = [Message.assistant([tool_use("b")], message_id="s"), results(tool_result("b", "ok"))]
    assert await HeadTailTruncate(10_000)(short, ctx) is short
    clear = ClearEveryTurn(keep=1, trigger_tokens=0)
    both = [*msgs, *short]
    out = await clear(both, ctx)
    assert out[1].content[0]["content"] == CLEARED and out[3] is both[3]  # type: ignore[index]


# -- the cost model -----------------------------------------------------------------------------


def _session() -> list[Message]:
    """Three calls; the third comes 10 minutes after the second (cache cold)."""

    def asst(mid: str, stamp: str, *blocks: dict[str, Any]) -> Message:
        return dataclasses.replace(
            Message.assistant(
                list(blocks), message_id=mid, usage=Usage(input_tokens=2_000, output_tokens=100)
            ),
            timestamp=stamp,
            model="claude-sonnet-4-6",
        )

    return [
        Message.user("x" * 3_000),
        asst("r1", "2026-01-01T00:00:00Z", tool_use("a", "Other")),
        results(tool_result("a", "y" * 6_000)),
        asst("r2", "2026-01-01T00:01:00Z", tool_use("b", "Other")),
        results(tool_result("b", "z" * 3_000)),
        asst("r3", "2026-01-01T00:11:00Z", {"type": "text", "text": "done"}),
    ]


@pytest.mark.asyncio
async def test_prefix_cache_model_by_hand(tmp_path: Path) -> None:
    msgs = _session()
    (none,) = await compare_pipelines(
        msgs, {"none": Pipeline([])}, lambda n: SessionContext("c", tmp_path / n)
    )
    # call 0 sends the prompt: 1,000 tokens at 3 chars/token; its usage says 2,000, so the
    # system prompt and tools are 1,000 more on every call
    assert none.calls == 3
    sizes = none.sizes
    assert sizes[0] == 2_000
    # call 1 adds the assistant tool_use and the 6,000-char result (2,000 tokens)
    tool_use_tokens = math.ceil((len("Other") + len(repr({"command": "x"}))) / 3)
    assert sizes[1] == 2_000 + tool_use_tokens + 2_000
    assert sizes[2] == sizes[1] + tool_use_tokens + 1_000
    # call 1 reads call 0's whole request (warm), writes the rest; call 2 is 10 min later: cold
    assert none.cache_read == sizes[0]
    assert none.cache_write == sizes[0] + (sizes[1] - sizes[0]) + sizes[2]
    assert none.prefix_breaks == 0
    price = price_for("claude-sonnet-4-6")
    expected = (
        none.cache_write * price.input * 1.25
        + none.cache_read * price.input * 0.1
        + 300 * price.output
    ) / 1e6
    assert none.cost_usd == pytest.approx(expected)


@pytest.mark.asyncio
async def test_prefix_breaks_are_counted(tmp_path: Path) -> None:
    @stage("rewrite_old", may_break_cache=True)
    async def rewrite_old(messages: list[Message], ctx: SessionContext) -> list[Message]:
        # changes the first message once the conversation has grown: a prefix break
        if len(messages) > 3:
            return [Message.user("changed"), *messages[1:]]
        return messages

    msgs = _session()
    runs = await compare_pipelines(
        msgs,
        {"none": Pipeline([]), "rewrite": Pipeline([rewrite_old])},
        lambda n: SessionContext("c", tmp_path / n),
        model=CacheModel(ttl_seconds=3_600),
    )
    assert [r.prefix_breaks for r in runs] == [0, 1]
    assert runs[0].cache_read > runs[1].cache_read


def test_prices(tmp_path: Path) -> None:
    assert price_for("claude-opus-4-6") == PRICES["opus-4-6"]
    assert price_for("claude-opus-4-20250514") == PRICES["opus-4"]
    assert price_for("claude-haiku-4-5-20251001") == PRICES["haiku-4"]
    assert price_for(None) == PRICES[""]
    table = tmp_path / "p.json"
    table.write_text(json.dumps({"sonnet": {"input": 1, "output": 2}}))
    assert load_prices(table) == {"sonnet": Price(1.0, 2.0)}
    table.write_text(json.dumps({"sonnet": {"input": 1}}))
    with pytest.raises(ValueError, match="'sonnet' needs 'input' and 'output'"):
        load_prices(table)


def test_cli_compare_on_the_demo(tmp_path: Path) -> None:
    session = tmp_path / "demo.jsonl"
    assert (
        run_cli("demo", "--replay", "--json", "--store", tmp_path, "--out", session).returncode == 0
    )
    png = tmp_path / "sizes.png"
    proc = run_cli(
        "replay",
        session,
        "--json",
        "--store",
        tmp_path / "cmp",
        "--compare",
        "none,truncate,clear-every-turn,default,microcompact=off",
        "--plot",
        png,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {
        r["compare"]["pipeline"]: r["compare"] for r in map(json.loads, proc.stdout.splitlines())
    }
    assert list(rows) == ["none", "truncate", "clear-every-turn", "default", "microcompact=off"]
    assert all(r["calls"] == 5 for r in rows.values())
    # the budget sends far less than no management, without breaking the prefix
    assert rows["default"]["tokens_sent"] < rows["none"]["tokens_sent"] * 0.7
    assert rows["default"]["prefix_breaks"] == rows["none"]["prefix_breaks"] == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    bad = run_cli("replay", session, "--compare", "fastest")
    assert bad.returncode == 2 and "unknown comparison point 'fastest'" in bad.stderr


@pytest.mark.asyncio
async def test_clear_every_turn_counts_results_without_an_id(tmp_path: Path) -> None:
    """A result without a tool_use_id is still a result: it counts toward ``keep`` and is
    cleared once older than the newest ``keep`` (as a harness clearing by position would)."""
    ctx = SessionContext("s", tmp_path)
    msgs = [
        Message.assistant([tool_use("a")], message_id="r"),
        Message.user([{"type": "tool_result", "content": "no id, older"}]),
        Message.assistant([tool_use("b")], message_id="s"),
        results(tool_result("b", "newest")),
    ]
    out = await ClearEveryTurn(keep=1, trigger_tokens=0)(msgs, ctx)
    assert out[1].content[0]["content"] == CLEARED  # type: ignore[index]
    assert out[3] is msgs[3]
