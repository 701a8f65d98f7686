"""Which HTTP/1.1 protocol the proxy command serves on, and what it does without httptools."""

from __future__ import annotations

import sys

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeline._cli.http_protocols import head_timed, http_parser


def test_auto_is_httptools_where_it_is_installed() -> None:
    assert http_parser() == "httptools"
    assert http_parser("h11") == "h11"
    assert issubclass(head_timed(5.0), HttpToolsProtocol)
    assert issubclass(head_timed(5.0, "h11"), H11Protocol)
    assert head_timed(5.0).head_timeout == 5.0
    # one class per deadline and parser (a connection handed to h11 asks for one)
    assert head_timed(5.0, "h11") is head_timed(5.0, "h11")
    assert head_timed(5.0) is head_timed(5.0, "httptools")


def test_without_httptools_auto_is_h11_and_asking_for_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "httptools", None)  # an import of it fails
    assert http_parser() == "h11"
    assert issubclass(head_timed(), H11Protocol)
    with pytest.raises(ImportError):
        http_parser("httptools")
    with pytest.raises(ValueError, match="one of auto, httptools, h11"):
        http_parser("nope")
