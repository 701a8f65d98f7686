"""A damaged or planted calibration file: logged and ignored, never a crash, never a negative or
infinite estimate; and the file is written private (0600)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Message, TokenTracker, Usage
from pipeline.tokens import calibration_path_for
from pipeline.tokens.state_file import decode_state, encode_state
from tests.builders import json_paths, results, tool_result, tool_use, user_text

SONNET = "claude-sonnet-4-5"
CODE = "def f(x):\n    return x + 1  # add one\n" * 40


def _step(msgs: list[Message], n: int, usage: Usage) -> list[Message]:
    return [
        *msgs,
        Message.assistant(
            [tool_use(f"t{n}", "Bash")], message_id=f"m{n}", usage=usage, model=SONNET
        ),
        results(tool_result(f"t{n}", CODE * 2)),
    ]


def _trained() -> TokenTracker:
    """A calibrated tracker after a few observed calls: learned multipliers, an overhead, errors."""
    tracker = TokenTracker()
    msgs: list[Message] = [user_text("start")]
    tracker.observe(msgs, Usage(input_tokens=900), model=SONNET)
    context = 1_000
    for n in range(6):
        msgs = _step(msgs, n, Usage(input_tokens=context, output_tokens=8))
        context += 1_500 + 97 * n
        tracker.observe(msgs, Usage(input_tokens=context), model=SONNET)
    return tracker


SAVED: dict[str, Any] = json.loads(json.dumps(_trained().state_dict()))
COLD = TokenTracker().state_dict()

PROBES: list[list[Message]] = [
    [user_text("hello")],  # no anchor: content plus the measured overhead
    _step([user_text("start")], 0, Usage(input_tokens=5_000, output_tokens=3)),  # an anchor
]


def _family(state: dict[str, Any]) -> dict[str, Any]:
    fam: dict[str, Any] = state["estimator"]["families"]["sonnet"]
    return fam


def _set(*path: str | int, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(state: dict[str, Any]) -> None:
        node: Any = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return apply


DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "families-a-list": _set("estimator", "families", value=[]),
    "mult-a-list": _set("estimator", "families", "sonnet", "mult", value=[1.0] * 10),
    "estimator-a-string": _set("estimator", value="x"),
    "multiplier-nan": _set("estimator", "families", "sonnet", "mult", "prose", value=math.nan),
    "multiplier-inf": _set("estimator", "families", "sonnet", "mult", "code", value=math.inf),
    "multiplier-negative": _set("estimator", "families", "sonnet", "mult", "code", value=-3.5),
    "multiplier-zero": _set("estimator", "families", "sonnet", "mult", "structure", value=0),
    "margin-floor-nan": _set("estimator", "config", "margin_floor", value=math.nan),
    "margin-cold-negative": _set("estimator", "config", "margin_cold", value=-5.0),
    "last-error-inf": _set("last_error", value=math.inf),
    "overhead-inf": _set("estimator", "overhead", value=math.inf),
    "overhead-negative": _set("estimator", "overhead", value=-(10**9)),
    "overhead-huge": _set("estimator", "overhead", value=10**4000),
    "error-window-huge": _set("error_window", value=10**30),
    "n-obs-negative": _set("estimator", "families", "sonnet", "n_obs", value=-1),
    "covariance-negative": _set("estimator", "families", "sonnet", "p", 0, 0, value=-1e6),
    "covariance-a-string": _set("estimator", "families", "sonnet", "p", 3, value="row"),
    "abs-noise-zero": _set("estimator", "config", "abs_noise", value=0),
    "weight-negative-call": _set("estimator", "config", "weights", "call", value=-1e4),
    "weights-a-list": _set("estimator", "config", "weights", value=[1, 2]),
    "config-unknown-key": _set("estimator", "config", "bogus", value=1),
    "family-unknown": _set("estimator", "last_family", value=["opus"]),
    "errors-entry-a-dict": _set("errors", 0, value={"a": 1}),
    "errors-growth-nan": _set("errors", 0, 2, value=math.nan),
    "method-a-list": _set("method", value=["calibrated"]),
    "version-true": _set("version", value=True),
}


def _write(path: Path, state: Any) -> None:
    path.write_text(json.dumps(state), encoding="utf-8")  # NaN and Infinity as JSON writes them


def _estimates_are_sane(tracker: TokenTracker) -> None:
    for msgs in PROBES:
        detail = tracker.estimate_detail(msgs, model=SONNET)
        assert 0 <= detail.total < 10**15 and detail.estimated_part >= 0
        assert math.isfinite(detail.margin) and math.isfinite(detail.new_tokens)
        assert 0 <= tracker.tokens_for_messages(msgs) < 10**15


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_calibration_file_is_logged_and_ignored(tmp_path: Path, damage: str) -> None:
    assert SAVED["estimator"]["families"]["sonnet"]["n_obs"] == 6  # the damage hits real data
    state = copy.deepcopy(SAVED)
    DAMAGE[damage](state)
    path = tmp_path / "token-calibration.json"
    _write(path, state)
    with structlog.testing.capture_logs() as logs:
        tracker = TokenTracker.load(path)
    assert tracker.state_dict() == COLD  # a cold start, as documented
    [event] = [e for e in logs if e["event"] == "token_calibration.load_failed"]
    assert event["log_level"] == "warning" and len(event["error"]) <= 210
    with pytest.raises(ValueError):  # and never another exception type
        TokenTracker.from_state_dict(state)
    _estimates_are_sane(tracker)


def test_the_intact_file_still_loads_warm(tmp_path: Path) -> None:
    path = tmp_path / "token-calibration.json"
    _write(path, SAVED)
    tracker = TokenTracker.load(path)
    assert tracker.state_dict() == SAVED and tracker.state_dict() != COLD
    _estimates_are_sane(tracker)


def test_a_file_nested_too_deeply_for_the_decoder_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "token-calibration.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    assert TokenTracker.load(path).state_dict() == COLD


def test_a_fifo_in_place_of_the_file_does_not_block_the_resume(tmp_path: Path) -> None:
    path = tmp_path / "token-calibration.json"
    os.mkfifo(path)
    done: list[TokenTracker] = []
    worker = threading.Thread(target=lambda: done.append(TokenTracker.load(path)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # let a blocked reader go (a writer that opens and closes at once)
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=10)
        pytest.fail("loading the calibration blocked on a FIFO")
    assert done[0].state_dict() == COLD


def test_the_calibration_file_is_private(tmp_path: Path, umask_zero: None) -> None:
    path = calibration_path_for(tmp_path / "root", "sess")
    tracker = _trained()
    assert tracker.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert tracker.save(path)  # replacing it keeps it private
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert TokenTracker.load(path).state_dict() == tracker.state_dict()


# --------------------------------------------------------------------------------------------
# Property: any value of a real saved state replaced by a hostile one
# --------------------------------------------------------------------------------------------


PATHS = list(json_paths(SAVED))
HOSTILE: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    -1,
    -1e300,
    0,
    1e308,
    10**30,
    10**4000,
    -(10**4000),
    True,
    None,
    "",
    "x",
    [],
    [1, 2, 3],
    [[math.nan]],
    {},
    {"a": 1},
]
_DROP = object()
mutations = st.lists(
    st.tuples(st.sampled_from(PATHS), st.sampled_from([*HOSTILE, _DROP])), min_size=1, max_size=3
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(changes=mutations)
def test_load_of_a_mutated_saved_state_never_raises(
    tmp_path_factory: pytest.TempPathFactory, changes: list[tuple[tuple[str | int, ...], Any]]
) -> None:
    state = copy.deepcopy(SAVED)
    for path, value in changes:
        node: Any = state
        try:
            for key in path[:-1]:
                node = node[key]
            if value is _DROP:
                del node[path[-1]]
            else:
                node[path[-1]] = copy.deepcopy(value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change replaced a container on this path
    file = tmp_path_factory.mktemp("cal") / "token-calibration.json"
    _write(file, state)
    tracker = TokenTracker.load(file)  # never raises
    _estimates_are_sane(tracker)
    # and the loaded state survives a learning step (the first call after a resume)
    msgs = _step(PROBES[1], 9, Usage(input_tokens=7_000, output_tokens=5))
    tracker.observe(msgs, Usage(input_tokens=9_500), model=SONNET)
    _estimates_are_sane(tracker)
    with contextlib.suppress(ValueError):  # the only exception a malformed state may raise
        TokenTracker.from_state_dict(state)


_PROGRAM = """
import sys
import anthropic
from pipeline.testing import Reply, ScriptedMessagesServer
from stages import wrap

def reply(body):
    return Reply([{"type": "text", "text": "ok " * 40}])

with ScriptedMessagesServer(reply) as server:
    raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
    client = wrap(raw, root=sys.argv[1])
    messages = [{"role": "user", "content": "start " * 200}]
    for k in range(6):  # calls in quick succession, then the program ends
        if sys.argv[2] == "stream":
            with client.messages.stream(model="m", max_tokens=50, messages=messages) as stream:
                answer = stream.get_final_message()
        else:
            answer = client.messages.create(model="m", max_tokens=50, messages=messages)
        messages += [
            {"role": "assistant", "content": answer.content[0].text},
            {"role": "user", "content": f"step {k} " * 300},
        ]
"""


@pytest.mark.parametrize("call", ["create", "stream"])
def test_a_program_that_exits_leaves_what_its_calibration_learned(
    tmp_path: Path, call: str
) -> None:
    """``wrap`` writes each call's calibration before the call returns: the program run again
    estimates -- and its stages that decide on estimates decide -- as it would have."""
    import subprocess
    import sys

    from tests.cli_support import clean_env

    subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(tmp_path / "root"), call],
        check=True,
        env=clean_env(PYTHONPATH=str(Path(__file__).resolve().parents[1])),
        timeout=120,
    )
    (path,) = (tmp_path / "root").rglob("token-calibration*.json")
    state = json.loads(path.read_text())
    assert len(state["errors"]) >= 5  # every call after the first was learned from


def test_a_calibration_is_rewritten_in_place_and_never_made_again(tmp_path: Path) -> None:
    """``wrap``'s per-call write: the first one creates the file, later ones write over it in
    place (no new directory entry: a program may remove its root right after a call), and a
    conversation removed meanwhile is not made again."""
    from pipeline.dropin.calibration import CalibrationSaves, load_calibration

    tracker = _trained()
    path = tmp_path / "conv" / "token-calibration.json"
    path.parent.mkdir()
    saves = CalibrationSaves(path, tracker.state_dict)
    saves.rewrite()
    assert not path.exists()  # nothing learned, nothing written
    saves.learned()
    saves.rewrite()
    inode = path.stat().st_ino
    assert load_calibration(path).state_dict() == tracker.state_dict()
    path.write_bytes(path.read_bytes() + b" " * 300)  # an older, longer state
    saves.learned()
    saves.rewrite()
    assert path.stat().st_ino == inode  # the same file: written over, not replaced
    assert decode_state(path.read_bytes()) == tracker.state_dict()
    assert {p.name for p in path.parent.iterdir()} == {path.name}
    path.unlink()
    path.parent.rmdir()  # the conversation removed meanwhile
    saves.learned()
    saves.rewrite()
    assert not path.parent.exists()


def test_rewriting_in_place_pads_a_longer_state_and_cuts_a_much_longer_one(
    tmp_path: Path,
) -> None:
    from pipeline.tokens.state_file import PAD_LIMIT, rewrite_state

    path = tmp_path / "state.json"
    assert rewrite_state(path, {"a": 1}) is None and not path.exists()  # never creates
    path.write_bytes(b'{"a":"' + b"x" * 100 + b'"}')
    assert rewrite_state(path, {"a": 2})
    assert path.stat().st_size == 108 and decode_state(path.read_bytes()) == {"a": 2}
    path.write_bytes(b'{"a":"' + b"x" * (PAD_LIMIT + 100) + b'"}')
    assert rewrite_state(path, {"a": 3})
    assert path.read_bytes() == encode_state({"a": 3})


def test_a_file_read_while_another_process_rewrites_it_loads_cold(tmp_path: Path) -> None:
    """A reader in another process may read a state rewritten in place half old, half new:
    valid JSON when the two lay out alike, yet a state neither wrote. Its check fails, and the
    load starts cold, as documented, instead of taking a mix of two calibrations."""
    from pipeline.tokens.state_file import rewrite_state, write_state

    old = copy.deepcopy(SAVED)
    new = copy.deepcopy(SAVED)
    new["estimator"]["families"]["sonnet"]["n_obs"] = 7  # as long as 6
    new["estimator"]["overhead"] = 10 ** (len(str(old["estimator"]["overhead"])) - 1)
    path = tmp_path / "token-calibration.json"
    assert write_state(path, old)
    before = path.read_bytes()
    assert rewrite_state(path, new)
    after = path.read_bytes()
    assert len(before) == len(after)
    parts = [k for k in range(len(after)) if before[k] != after[k]]
    cut = parts[len(parts) // 2]  # where a reader met the writer: new before, old after
    assert before[:cut] != after[:cut] and before[cut:] != after[cut:]
    path.write_bytes(after[:cut] + before[cut:])
    with structlog.testing.capture_logs() as logs:
        tracker = TokenTracker.load(path)
    assert tracker.state_dict() == COLD
    assert [e["event"] for e in logs] == ["token_calibration.load_failed"]
    path.write_bytes(after)
    assert TokenTracker.load(path).state_dict() == new  # the whole new state loads warm


def test_a_state_saved_without_a_check_loads_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "token-calibration.json"
    path.write_text(json.dumps(SAVED, separators=(",", ":")), encoding="utf-8")
    assert TokenTracker.load(path).state_dict() == SAVED


def test_what_is_planted_in_place_of_the_file_is_replaced_never_written_through(
    tmp_path: Path,
) -> None:
    """A link, a FIFO or a hard link where the calibration belongs is replaced by a file of
    its own (as an atomic write replaces it), never written through nor kept failing."""
    from pipeline.dropin.calibration import CalibrationSaves
    from pipeline.tokens.state_file import rewrite_state

    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not yours")
    tracker = _trained()
    for plant in ("symlink", "fifo", "hardlink"):
        path = tmp_path / plant / "token-calibration.json"
        path.parent.mkdir()
        if plant == "symlink":
            path.symlink_to(elsewhere)
        elif plant == "fifo":
            os.mkfifo(path)
        else:
            os.link(elsewhere, path)
        assert rewrite_state(path, {"a": 1}) is None, plant
        saves = CalibrationSaves(path, tracker.state_dict)
        saves.learned()
        saves.rewrite()
        assert path.is_file() and not path.is_symlink(), plant
        assert decode_state(path.read_bytes()) == tracker.state_dict(), plant
        assert elsewhere.read_text() == "not yours", plant


def test_a_calibration_is_written_before_the_call_returns(tmp_path: Path) -> None:
    """What a call taught the tracker is on disk when the call returns, and nothing is
    written under the root after: a program that removes its root right after its last call
    (a temporary directory) never races a write of ours."""
    import anthropic

    from pipeline.dropin.wrap import SYNCS
    from pipeline.testing import Reply, ScriptedMessagesServer
    from stages import wrap

    def reply(body: Any) -> Reply:
        return Reply([{"type": "text", "text": "ok " * 40}])

    root = tmp_path / "root"
    with ScriptedMessagesServer(reply) as server:
        raw = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        client = wrap(raw, root=root)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "start " * 200}]
        for k in range(4):
            answer = client.messages.create(model="m", max_tokens=50, messages=messages)
            (path,) = root.rglob("token-calibration*.json")
            assert len(json.loads(path.read_bytes())["errors"]) == k  # this call's, already
            messages += [
                {"role": "assistant", "content": answer.content[0].text},
                {"role": "user", "content": f"step {k} " * 300},
            ]
        listing = sorted(p.relative_to(root) for p in root.rglob("*"))
        SYNCS.flush()  # what the sync thread had left: fsyncs only
        assert sorted(p.relative_to(root) for p in root.rglob("*")) == listing
        raw.close()


def test_no_cut_of_an_in_place_rewrite_reads_as_a_state_neither_wrote() -> None:
    """Every place a reader may meet an in-place rewrite (new bytes before it, old after),
    the key names included: what it reads is the old state, the new one, or refused -- the
    check comes first, so a file cut anywhere still starts with one."""
    for shorter in (0, 1, 5, 12):  # a shorter new state is padded with spaces
        old = encode_state({"version": 2, "alpha": "1" * 16, "n": 12})
        fresh = encode_state({"version": 2, "bravo": "2" * (16 - shorter), "n": 34})
        new = fresh + b" " * (len(old) - len(fresh))
        assert len(old) == len(new)
        for cut in range(len(new) + 1):
            mixed = new[:cut] + old[cut:]
            if mixed in (old, new):
                continue
            with pytest.raises(ValueError):
                decode_state(mixed)


def test_a_check_that_is_not_the_first_field_is_refused() -> None:
    text = json.dumps({"version": 2, "check": "00000000"}).encode()
    with pytest.raises(ValueError, match="first field"):
        decode_state(text)
