"""Random sequences of requests over a family whose forks are let go (``max_branches`` 2 or
3) and a process that restarts: forks, continuations, retries, rewinds. Whatever was let go,
a conversation goes on with the bytes it sent, under its name while its last request is its
own, and a fork repeats what it shares with the conversation it went its own way from."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline.dropin.conversations import Conversations
from tests.test_conversations import answer, call, registry, send, user

SIZES = (10, 1_500, 5_000)
"""Result sizes: under, near and over the registry's budget (3,000), so some are replaced."""


class _Model:
    """What each line (a conversation as its client sees it) sent last, and where it went."""

    def __init__(self, root: Path, max_branches: int) -> None:
        self.root = root
        self.conversations: Conversations = registry(root, max_branches=max_branches)
        self.messages: list[list[dict[str, Any]]] = []
        self.sent: list[list[Any]] = []
        self.names: list[str] = []
        self.last_of: dict[str, list[dict[str, Any]]] = {}
        """By conversation: the messages last routed there."""
        self.results = 0

    def result(self, rng: random.Random) -> list[dict[str, Any]]:
        self.results += 1
        n = self.results
        return [call(f"t{n}"), answer(f"t{n}", f"r{n}:" + "abcdefgh"[n % 8] * rng.choice(SIZES))]

    async def send(self, line: int, messages: list[dict[str, Any]], where: str) -> None:
        """Send ``messages`` as ``line``; check what it repeats of its last request went as
        before, and its name where its last request is still its own."""
        branch, sent = await send(self.conversations, messages)
        name = branch.conversation_id
        if line < len(self.messages):
            before, sent_before = self.messages[line], self.sent[line]
            shared = 0
            while shared < min(len(before), len(messages)) and before[shared] == messages[shared]:
                shared += 1
            assert sent[:shared] == sent_before[:shared], f"{where}: bytes changed"
            if len(messages) >= len(before) and self.last_of.get(self.names[line]) == before:
                assert name == self.names[line], f"{where}: went to {name}"
            self.messages[line], self.sent[line], self.names[line] = messages, sent, name
        else:
            self.messages.append(messages)
            self.sent.append(sent)
            self.names.append(name)
        self.last_of[name] = messages


async def _sequence(root: Path, seed: int) -> None:
    rng = random.Random(seed)
    model = _Model(root, rng.choice((2, 3)))
    await model.send(0, [user("task"), *model.result(rng)], "start")
    for step in range(24):
        line = rng.randrange(len(model.messages))
        messages = model.messages[line]
        roll = rng.random()
        where = f"seed {seed} step {step}"
        if roll < 0.4:  # goes on
            await model.send(line, [*messages, *model.result(rng)], f"{where} goes on")
        elif roll < 0.65:  # a fork: a new line from a prefix ending with a user message
            k = rng.randrange(1, len(messages) + 1, 2)
            fork = [*messages[:k], *model.result(rng)]
            before = model.sent[line][:k]
            await model.send(len(model.messages), fork, f"{where} fork")
            assert model.sent[-1][:k] == before, f"{where}: a fork changed what it shares"
        elif roll < 0.75:  # rewound
            k = rng.randrange(1, len(messages) + 1, 2)
            await model.send(line, messages[:k], f"{where} rewind")
        elif roll < 0.9:  # the same request again
            await model.send(line, list(messages), f"{where} retry")
        else:  # a new process over the same store
            model.conversations = registry(model.root, max_branches=rng.choice((2, 3)))


@pytest.mark.parametrize("chunk", range(4))
def test_random_forks_let_go_keep_their_bytes_and_names(tmp_path: Path, chunk: int) -> None:
    for seed in range(chunk * 40, chunk * 40 + 40):
        root = tmp_path / str(seed)
        anyio.run(_sequence, root, seed)
