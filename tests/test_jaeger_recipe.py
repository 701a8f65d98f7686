"""The Jaeger recipe (examples/jaeger) stays current and agrees with the code: a Jaeger v2 image,
the standard port of each OTLP protocol the CLI exports with published as itself, the UI port,
and README commands that point each protocol at its port."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from pipeline._cli.telemetry import (
    DEFAULT_OTLP_PROTOCOL,
    OTLP_DEFAULT_PORTS,
    OTLP_ENDPOINT_VARS,
    OTLP_PROTOCOL_VARS,
)

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "jaeger"
UI_PORT = 16686
JAEGER_V2_IMAGE = re.compile(r"^(?:cr\.jaegertracing\.io/)?jaegertracing/jaeger:(2\.\d+\.\d+)$")


def _jaeger_service() -> dict[str, Any]:
    compose = yaml.safe_load((RECIPE / "compose.yaml").read_text(encoding="utf-8"))
    assert isinstance(compose, dict)
    services = compose["services"]
    assert list(services) == ["jaeger"]
    service: dict[str, Any] = services["jaeger"]
    return service


def _published(entry: str | int | dict[str, Any]) -> tuple[int, int]:
    """(host port, container port) of one ``ports:`` entry, short or long syntax (TCP only)."""
    if isinstance(entry, dict):
        assert entry.get("protocol", "tcp") == "tcp", entry
        return int(entry["published"]), int(entry["target"])
    spec = str(entry)
    assert not spec.endswith("/udp"), spec
    parts = spec.removesuffix("/tcp").split(":")  # [ip:]host:container, or container alone
    return int(parts[-2] if len(parts) > 1 else parts[-1]), int(parts[-1])


def _ports() -> dict[int, int]:
    return dict(_published(e) for e in _jaeger_service()["ports"])


def test_compose_file_uses_a_jaeger_v2_image() -> None:
    image = _jaeger_service()["image"]
    assert JAEGER_V2_IMAGE.match(image), image  # pinned, not :latest, not the v1 all-in-one


def test_compose_file_publishes_the_ports_the_cli_exports_to() -> None:
    ports = _ports()
    for protocol, port in OTLP_DEFAULT_PORTS.items():
        # the default endpoint of each protocol reaches Jaeger's receiver for it
        assert ports.get(port) == port, (protocol, port, ports)
    assert ports.get(UI_PORT) == UI_PORT


def _demo_commands() -> list[dict[str, str]]:
    """The environment assignments of each ``python -m pipeline demo`` line in the README."""
    commands = []
    for line in (RECIPE / "README.md").read_text(encoding="utf-8").splitlines():
        if "python -m pipeline demo" not in line:
            continue
        words = shlex.split(line.strip())
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        commands.append(env)
    return commands


def test_readme_runs_the_demo_over_each_protocol_against_the_compose_ports() -> None:
    commands = _demo_commands()
    seen = set()
    for env in commands:
        chosen = [env[v] for v in OTLP_PROTOCOL_VARS if v in env]
        protocol = chosen[0] if chosen else DEFAULT_OTLP_PROTOCOL
        endpoints = [env[v] for v in OTLP_ENDPOINT_VARS if v in env]
        assert endpoints, env
        port = int(endpoints[0].rsplit(":", 1)[1].split("/")[0])
        assert port == OTLP_DEFAULT_PORTS.get(protocol), env
        seen.add(protocol)
    assert seen == set(OTLP_DEFAULT_PORTS), commands


def test_readme_names_the_same_image_and_ports() -> None:
    readme = (RECIPE / "README.md").read_text(encoding="utf-8")
    image = _jaeger_service()["image"]
    assert image in readme
    assert "all-in-one:1." not in readme and "COLLECTOR_OTLP_ENABLED" not in readme
    for port in (*OTLP_DEFAULT_PORTS.values(), UI_PORT):
        assert str(port) in readme
    assert "docker compose -f examples/jaeger/compose.yaml up" in readme
