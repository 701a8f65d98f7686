"""Text from a transcript made safe to print on a terminal.

Ids, tool names and paths come from the recorded session, which may hold anything: an escape
sequence in a ``message.id`` would otherwise retitle the terminal, clear it or recolour what
follows. Human-readable output passes such values through :func:`terminal_safe`; JSON output
needs nothing (``json.dumps`` escapes control characters itself).
"""

from __future__ import annotations

__all__ = ["terminal_safe"]


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def terminal_safe(text: str) -> str:
    """``text`` with every non-printable character (control and format characters, lone
    surrogates, line and paragraph separators) written as a ``repr``-style escape (``\\x1b``,
    ``\\u202e``); printable text, spaces included, is returned as it is."""
    if text.isprintable():  # the common case, checked in C
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)
