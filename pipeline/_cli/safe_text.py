"""Text from a transcript made safe to print on a terminal.

Ids, tool names and paths come from the recorded session, which may hold anything: an escape
sequence in a ``message.id`` would otherwise retitle the terminal, clear it or recolour what
follows. Human-readable output passes such values through :func:`terminal_safe`; JSON output
needs nothing (``json.dumps`` escapes control characters itself).
"""

from __future__ import annotations

__all__ = ["readable_safe", "terminal_safe"]


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


MAX_SHOWN = 300
"""The most characters of one value a line shows (a valid id may be a megabyte long)."""


def terminal_safe(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` with every non-printable character (control and format characters, lone
    surrogates, line and paragraph separators) written as a ``repr``-style escape (``\\x1b``,
    ``\\u202e``), and cut to its first ``limit`` characters (``…(N chars)`` says how long it
    was); short printable text, spaces included, is returned as it is."""
    long = len(text) > limit
    cut = text[:limit] if long else text
    if not cut.isprintable():  # the common case is checked in C
        cut = "".join(ch if ch.isprintable() else _escape(ch) for ch in cut)
    return f"{cut}…({len(text):,} chars)" if long else cut


def readable_safe(text: str) -> str:
    """Text to be read whole on a terminal (a model's answer): :func:`terminal_safe`'s escapes
    for every character a terminal would act on, its lines and tabs kept, never cut."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in "\n\t" else _escape(ch) for ch in text)
