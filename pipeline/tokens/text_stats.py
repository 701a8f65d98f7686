"""Cheap statistics of a text: character-category counts (exact up to 16 KB, sampled above)
and the content class they put it in. Nothing here copies or serialises more than a sample."""

from __future__ import annotations

import math
import re
from typing import Literal, NamedTuple

from pipeline.tokens.priors import FEATURE_INDEX, FEATURES

__all__ = ["TextKind", "TextStats", "looks_like_json", "text_class", "text_stats"]


def looks_like_json(text: str) -> bool:
    """First and last non-blank characters are ``{}`` or ``[]`` (the reference's test).

    Same answer as testing ``text.strip()``, without copying a long text: only its ends are
    looked at (the first and last 256 characters hold a non-blank unless the text is padded).
    """
    head = tail = ""
    if len(text) > 512:
        head, tail = text[:256].lstrip(), text[-256:].rstrip()
    if not head or not tail:
        head = tail = text.strip()
        if len(head) < 2:
            return False
    return (head[0] == "{" and tail[-1] == "}") or (head[0] == "[" and tail[-1] == "]")


_SAMPLE_FULL = 16_384  # texts up to this many chars are counted exactly
_SAMPLE_WINDOWS = 32
_SAMPLE_WINDOW = 512


_LETTER, _DIGIT_BIT, _BLANK, _NEWLINE, _OTHER, _LEAD, _CONTINUATION = 1, 2, 4, 8, 16, 32, 64
_CJK_LEAD = 128


def _byte_class(b: int) -> int:
    """UTF-8 byte -> its category, one bit each: ASCII letters, digits, blanks, newline, other
    ASCII, lead bytes (one per non-ASCII character), continuation bytes; lead bytes that may
    start a CJK character (U+3000-U+DFFF, U+F000-U+FFFF) also carry ``_CJK_LEAD``."""
    if b >= 0xC0:
        return _LEAD | _CJK_LEAD if 0xE3 <= b <= 0xED or b == 0xEF else _LEAD
    if b >= 0x80:
        return _CONTINUATION
    ch = chr(b)
    if ch.isalpha():
        return _LETTER
    if ch.isdigit():
        return _DIGIT_BIT
    if b == 10:
        return _NEWLINE
    return _BLANK if ch in " \t\r\f\v" else _OTHER


# The sample's bytes become their category bits (bytes.translate), then one integer, byte i at
# bits 8i..8i+7 (int.from_bytes): each count is an AND with a mask and a popcount, and the runs
# (words, blank runs) are the bytes of a class less those whose predecessor is of it too --
# popcount(x) - popcount(x & (x << 8)).
# All of it runs in C over 30-bit digits: about twice as fast as bytes.count per category.
_CATEGORY = bytes(_byte_class(b) for b in range(256))
_BITS = (_LETTER, _DIGIT_BIT, _BLANK, _NEWLINE, _OTHER, _LEAD, _CJK_LEAD)


def _build_masks(size: int) -> tuple[int, dict[int, int]]:
    return size, {bit: int.from_bytes(bytes((bit,)) * size, "little") for bit in _BITS}


_masks = _build_masks(_SAMPLE_FULL + _SAMPLE_WINDOWS)  # a sample of ASCII text fits


def _masks_for(size: int) -> dict[int, int]:
    """Masks of at least ``size`` bytes (grown for a non-ASCII sample, up to 4 bytes a char)."""
    global _masks
    masks = _masks  # one read: another thread may swap in larger masks meanwhile
    if masks[0] < size:
        masks = _masks = _build_masks(max(size, 4 * masks[0]))
    return masks[1]


_CJK = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)
_RUN_MIN = 64
"""The shortest base64-alphabet run that counts as a blob."""
_RUN_DIGIT_SHARE = 0.05
"""The least share of digits in a blob (random base64 has ~16 %)."""
_B64_RUN = re.compile(rf"[A-Za-z0-9+/=_-]{{{_RUN_MIN},}}")
_RUN_DIGITS = math.ceil(_RUN_DIGIT_SHARE * _RUN_MIN)
"""Digits the shortest random-looking run holds (see :func:`_random_looking`)."""
_UPPER_BYTES = bytes(range(ord("A"), ord("Z") + 1))
_DIGIT_BYTES = b"0123456789"


def _sample(text: str) -> tuple[str, float]:
    """The text itself when short, else evenly spaced windows; and the scale back to full size."""
    n = len(text)
    if n <= _SAMPLE_FULL:
        return text, 1.0
    step = (n - _SAMPLE_WINDOW) / (_SAMPLE_WINDOWS - 1)
    parts = [text[int(k * step) : int(k * step) + _SAMPLE_WINDOW] for k in range(_SAMPLE_WINDOWS)]
    sample = "\n".join(parts)  # the joins add _SAMPLE_WINDOWS - 1 newlines, removed by the caller
    return sample, n / (len(sample) - (_SAMPLE_WINDOWS - 1))


class TextStats(NamedTuple):
    """Character-category counts of one text (scaled up from a sample above 16 KB); a named
    tuple, made once per text priced."""

    chars: int
    features: tuple[float, ...]
    """In :data:`FEATURES` order; ``tool_blocks`` and ``call`` are 0 for text."""
    escapes: int
    """ESC characters (ANSI terminal output)."""
    cjk: float
    """CJK characters."""
    base64_share: float
    """Share of the sample inside long, random-looking base64-alphabet runs."""


def text_stats(text: str) -> TextStats:
    """Count ``text``'s features: exactly up to 16 KB, else on 32 windows of 512 chars."""
    n = len(text)
    if n == 0:
        return TextStats(0, (0.0,) * len(FEATURES), 0, 0.0, 0.0)
    sample, scale = _sample(text)
    t = sample.encode("utf-8", "surrogatepass").translate(_CATEGORY)
    x, m = int.from_bytes(t, "little"), _masks_for(len(t))
    letter_bits, blank_bits = x & m[_LETTER], x & m[_BLANK]
    letters, spaces = letter_bits.bit_count(), blank_bits.bit_count()
    newlines, digits = (x & m[_NEWLINE]).bit_count(), (x & m[_DIGIT_BIT]).bit_count()
    # ASCII (a flag the string carries) has five categories: the fifth is what is left
    if sample.isascii():
        non_ascii, other = 0, len(t) - letters - newlines - spaces - digits
    else:
        non_ascii, other = (x & m[_LEAD]).bit_count(), (x & m[_OTHER]).bit_count()
    if scale != 1.0:
        newlines -= _SAMPLE_WINDOWS - 1  # the window joins
    words = letters - (letter_bits & (letter_bits << 8)).bit_count()
    ws_runs = spaces - (blank_bits & (blank_bits << 8)).bit_count()
    # every CJK character starts with one of the flagged lead bytes: none, no search
    maybe_cjk = non_ascii and (x & m[_CJK_LEAD])
    cjk = float(len(_CJK.findall(sample))) * scale if maybe_cjk else 0.0
    b64 = 0.0
    # blobs have no blanks; and the shortest blob holds _RUN_DIGITS digits, so a sample with
    # fewer holds none
    if n >= _RUN_MIN and digits >= _RUN_DIGITS and (spaces + newlines) < 0.02 * len(sample):
        b64 = sum(len(r) for r in _B64_RUN.findall(sample) if _random_looking(r)) / len(sample)
    features = (
        words * scale,
        letters * scale,
        digits * scale,
        other * scale,
        ws_runs * scale,
        max(0, newlines) * scale,
        non_ascii * scale,
        0.0,
        0.0,
    )
    return TextStats(n, features, text.count("\x1b"), cjk, b64)


def _random_looking(run: str) -> bool:
    """A base64-alphabet run that is a blob, not a path or identifier: mixed case and digits,
    few separators (random base64: ~40 % upper, ~16 % digits, ~3 % '+/')."""
    n = len(run)
    raw = run.encode("ascii")  # the run's alphabet is ASCII; deleting bytes counts them in C
    upper = n - len(raw.translate(None, _UPPER_BYTES))
    digits = n - len(raw.translate(None, _DIGIT_BYTES))
    separators = raw.count(b"/") + raw.count(b"-") + raw.count(b"_")
    return upper >= 0.15 * n and digits >= _RUN_DIGIT_SHARE * n and separators <= 0.05 * n


TextKind = Literal["text", "thinking", "json", "error"]


def text_class(text: str, stats: TextStats, *, kind: TextKind = "text") -> str:
    """The content class of one text segment (cheap tests on its statistics)."""
    if kind in ("thinking", "error"):
        return kind
    n = max(1, stats.chars)
    if stats.escapes and stats.escapes / n > 0.002:
        return "terminal"
    if stats.cjk / n > 0.2:
        return "cjk"
    if stats.base64_share > 0.5:
        return "base64"
    if kind == "json" or looks_like_json(text):
        return "json"
    letters = stats.features[FEATURE_INDEX["letters"]]
    punct = stats.features[FEATURE_INDEX["punct"]]
    if punct / n < 0.10 and letters / n > 0.5:
        return "prose"
    return "code"
