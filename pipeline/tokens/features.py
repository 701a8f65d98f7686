"""What a message costs in tokens, before any calibration: content, features, classes, priors.

Pure functions of a message's wire-visible content, shared by both token estimators:

- :func:`iter_segments` walks a message the way the API sees it and yields the pieces to price
  (the reference estimator in :mod:`pipeline.tokens` and the calibrated one in
  :mod:`pipeline.tokens.calibrated` both price these same segments);
- :func:`text_stats` reduces a text to a few cheap character-category counts (exact up to
  16 KB, sampled above), :func:`text_class` puts it in a content class;
- :func:`content_vector` turns a message into base tokens per content class, with the
  :data:`PRIOR_WEIGHTS` (tokens per feature) fitted on real Claude Code usage deltas;
- :func:`image_tokens` prices an image from its pixel size, read off the base64 header.

Nothing here serialises a whole message or session: only ``tool_use`` inputs and unknown
blocks are turned into JSON, one block at a time.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.messages import Message

__all__ = [
    "CLASSES",
    "CLASS_INDEX",
    "FAMILIES",
    "FEATURES",
    "IMAGE_TOKENS",
    "OTHER_FAMILY_SD_FLOOR",
    "PRIOR_MULTIPLIER",
    "PRIOR_SD",
    "PRIOR_WEIGHTS",
    "ContentVector",
    "Segment",
    "TextStats",
    "content_vector",
    "image_size",
    "image_tokens",
    "is_wire_visible",
    "iter_segments",
    "looks_like_json",
    "model_family",
    "text_class",
    "text_stats",
]

IMAGE_TOKENS = 2_000
"""Fixed estimate for an image or document block (SPEC §4): base64 length says nothing about
tokens. The calibrated estimator falls back to it for images it cannot size and for non-text
documents."""

# ---------------------------------------------------------------------------------------------
# Features, classes, priors
# ---------------------------------------------------------------------------------------------

FEATURES: tuple[str, ...] = (
    "words",  # runs of ASCII letters
    "letters",  # ASCII letters
    "digits",
    "punct",  # ASCII characters that are not letters, digits or whitespace
    "ws_runs",  # runs of spaces/tabs/CR
    "newlines",
    "non_ascii",  # characters > U+007F
    "tool_blocks",  # one per tool_use and per tool_result block (ids, wrappers)
    "call",  # one per call: turn markers and what the harness adds each turn
)
_F = {name: i for i, name in enumerate(FEATURES)}

PRIOR_WEIGHTS: dict[str, float] = {
    # Tokens per unit of each feature: a Huber fit on the usage deltas of the 27 Claude Code
    # files of the research corpus (1,384 calls without compaction or model-family switch;
    # Claude Opus 4 / 4.6, Sonnet 4 / 4.5, Haiku 4.5). Read them as a whole, not one by one:
    # the features are collinear (a newline in a Read listing comes with a number and an arrow),
    # which is why whitespace runs carry a negative weight.
    "words": 1.6695,
    "letters": 0.0143,
    "digits": 0.7415,
    "punct": 0.5802,
    "ws_runs": -0.4726,
    "newlines": 2.5086,
    "non_ascii": 1.1715,
    "tool_blocks": 41.7952,
    "call": 16.4842,
}

CLASSES: tuple[str, ...] = (
    "prose",
    "code",  # code, logs, listings, paths: anything punctuation-dense that is not JSON
    "json",  # JSON-looking text and tool_use inputs
    "thinking",
    "error",  # tool_result with is_error (hook feedback may be shown to the model twice)
    "terminal",  # ANSI-escape-heavy terminal output
    "cjk",
    "base64",
    "structure",  # per-block and per-call overheads
    "media",  # images and documents
)
CLASS_INDEX: dict[str, int] = {name: i for i, name in enumerate(CLASSES)}
"""Position of each class in :data:`CLASSES` (and in a :class:`ContentVector`)."""

FAMILIES: tuple[str, ...] = ("opus", "sonnet", "haiku", "other")

PRIOR_MULTIPLIER: dict[str, float] = {c: 1.0 for c in CLASSES} | {"base64": 1.5}
"""Start value of each class multiplier. base64 had no corpus evidence: start pessimistic."""

PRIOR_SD: dict[str, float] = {
    "prose": 0.02,
    "code": 0.02,
    "json": 0.02,
    "structure": 0.02,
    "thinking": 0.3,
    "error": 1.0,
    "terminal": 0.3,
    "cjk": 0.3,
    "base64": 0.3,
    "media": 0.3,
}
"""Prior standard deviation of each multiplier. Small for the well-measured classes (sessions
sit within ~2 % of the corpus fit, so fast learning there only adds noise); large where the
cost depends on the harness (errors: hook output may be sent twice) or was never measured."""

OTHER_FAMILY_SD_FLOOR = 0.15
"""An unknown model family may have another tokenizer: every multiplier learns fast."""


def model_family(model: str | None) -> str:
    """``opus`` / ``sonnet`` / ``haiku`` by substring of the model name, else ``other``."""
    name = (model or "").lower()
    for family in ("opus", "sonnet", "haiku"):
        if family in name:
            return family
    return "other"


# ---------------------------------------------------------------------------------------------
# Wire-visible content as segments
# ---------------------------------------------------------------------------------------------

SegmentKind = Literal["text", "thinking", "tool_use", "tool_result", "media", "other"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of a message's wire-visible content, as the estimators price it."""

    kind: SegmentKind
    text: str = ""
    """What to price: block text, thinking, ``name + JSON(input)`` of a tool_use, the JSON of
    an unknown block. Empty for a tool_result's wrapper (its content follows as text
    segments) and for media."""
    block: Mapping[str, Any] | None = None
    """The image or document block (``media`` only)."""
    error: bool = False
    """Text inside an ``is_error`` tool_result."""


def is_wire_visible(message: Message) -> bool:
    """Progress and system records are not sent, except ``local_command`` output."""
    return message.type != "progress" and not (
        message.type == "system" and message.subtype != "local_command"
    )


def iter_segments(message: Message) -> Iterator[Segment]:
    """The segments of one message's content (visibility is the caller's test)."""
    content = message.content
    if isinstance(content, str):
        if content:
            yield Segment("text", content)
        return
    for block in content:
        if isinstance(block, Mapping):
            try:
                yield from _block_segments(block, error=False)
            except RecursionError:  # a block built past what JSON can be written for
                raise ValueError(
                    f"record {message.uuid!r}: a content block is nested too deeply to measure"
                ) from None


def _block_segments(block: Mapping[str, Any], *, error: bool) -> Iterator[Segment]:
    btype = block.get("type")
    if btype == "text":
        yield Segment("text", str(block.get("text") or ""), error=error)
    elif btype == "thinking":
        yield Segment("thinking", str(block.get("thinking") or ""))
    elif btype == "redacted_thinking":
        yield Segment("thinking", str(block.get("data") or ""))
    elif btype in ("image", "document"):
        yield Segment("media", block=block)
    elif btype == "tool_use":
        name = str(block.get("name") or "")
        yield Segment(
            "tool_use", name + json.dumps(block.get("input"), ensure_ascii=False, default=str)
        )
    elif btype == "tool_result":
        yield Segment("tool_result")
        failed = bool(block.get("is_error"))
        content = block.get("content")
        if isinstance(content, str):
            yield Segment("text", content, error=failed)
        elif isinstance(content, list):
            for inner in content:
                if isinstance(inner, Mapping):
                    yield from _block_segments(inner, error=failed)
    else:  # unknown and server blocks: their JSON, one block at a time
        yield Segment("other", json.dumps(block, ensure_ascii=False, default=str))


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


# ---------------------------------------------------------------------------------------------
# Cheap text statistics
# ---------------------------------------------------------------------------------------------

_SAMPLE_FULL = 16_384  # texts up to this many chars are counted exactly
_SAMPLE_WINDOWS = 32
_SAMPLE_WINDOW = 512


def _byte_class(b: int) -> int:
    """UTF-8 byte -> category byte: letters 'a', digits '0', blanks ' ', newline, other ASCII
    '.', lead bytes 'u' (one per non-ASCII character), continuation bytes 'c'."""
    if b >= 0xC0:
        return ord("u")
    if b >= 0x80:
        return ord("c")
    ch = chr(b)
    if ch.isalpha():
        return ord("a")
    if ch.isdigit():
        return ord("0")
    if b == 10:
        return 10
    return 32 if ch in " \t\r\f\v" else ord(".")


# bytes.translate + bytes.count keep every count at C speed
_CATEGORY = bytes(_byte_class(b) for b in range(256))
_ONLY_LETTERS = bytes(ord("a") if b == ord("a") else ord("x") for b in range(256))
_ONLY_BLANKS = bytes(32 if b == 32 else ord("x") for b in range(256))
_CJK = re.compile(
    "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)
_B64_RUN = re.compile(r"[A-Za-z0-9+/=_-]{64,}")
_UPPER = re.compile("[A-Z]")
_DIGIT = re.compile("[0-9]")


def _sample(text: str) -> tuple[str, float]:
    """The text itself when short, else evenly spaced windows; and the scale back to full size."""
    n = len(text)
    if n <= _SAMPLE_FULL:
        return text, 1.0
    step = (n - _SAMPLE_WINDOW) / (_SAMPLE_WINDOWS - 1)
    parts = [text[int(k * step) : int(k * step) + _SAMPLE_WINDOW] for k in range(_SAMPLE_WINDOWS)]
    sample = "\n".join(parts)  # the joins add _SAMPLE_WINDOWS - 1 newlines, removed by the caller
    return sample, n / (len(sample) - (_SAMPLE_WINDOWS - 1))


@dataclass(frozen=True, slots=True)
class TextStats:
    """Character-category counts of one text (scaled up from a sample above 16 KB)."""

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
    letters = t.count(b"a")
    newlines = t.count(b"\n")
    spaces = t.count(b" ")
    non_ascii = t.count(b"u")
    if scale != 1.0:
        newlines -= _SAMPLE_WINDOWS - 1  # the window joins
    # a run starts where "xa" occurs once every other category is mapped to "x"; the pattern
    # cannot overlap itself, so bytes.count is exact
    first = t[:1]
    words = t.translate(_ONLY_LETTERS).count(b"xa") + (first == b"a")
    ws_runs = t.translate(_ONLY_BLANKS).count(b"x ") + (first == b" ")
    cjk = float(len(_CJK.findall(sample))) * scale if non_ascii else 0.0
    b64 = 0.0
    if n >= 64 and (spaces + newlines) < 0.02 * len(sample):  # blobs have no blanks
        b64 = sum(len(r) for r in _B64_RUN.findall(sample) if _random_looking(r)) / len(sample)
    features = (
        words * scale,
        letters * scale,
        t.count(b"0") * scale,
        t.count(b".") * scale,
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
    upper = len(_UPPER.findall(run))
    digits = len(_DIGIT.findall(run))
    separators = run.count("/") + run.count("-") + run.count("_")
    return upper >= 0.15 * n and digits >= 0.05 * n and separators <= 0.05 * n


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
    letters, punct = stats.features[_F["letters"]], stats.features[_F["punct"]]
    if punct / n < 0.10 and letters / n > 0.5:
        return "prose"
    return "code"


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def _webp_size(head: bytes) -> tuple[int, int] | None:
    kind = head[12:16]
    if kind == b"VP8X":
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if kind == b"VP8 ":
        w, h = struct.unpack("<HH", head[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8L":
        b = head[21:25]
        w = 1 + (((b[1] & 0x3F) << 8) | b[0])
        h = 1 + (((b[3] & 0xF) << 10) | (b[2] << 2) | ((b[1] & 0xC0) >> 6))
        return w, h
    return None


def _jpeg_size(data: str) -> tuple[int, int] | None:
    """Walk the JPEG segments to the first SOFn, reading at most the first 16 KB."""
    try:
        raw = base64.b64decode(data[: 4 * 16_384], validate=False)
    except (binascii.Error, ValueError):
        return None
    i = 2
    while i + 9 < len(raw):
        if raw[i] != 0xFF:
            i += 1
            continue
        marker = raw[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            h, w = struct.unpack(">HH", raw[i + 5 : i + 9])
            return int(w), int(h)
        i += 2 + int.from_bytes(raw[i + 2 : i + 4], "big")
    return None


def image_size(data: str) -> tuple[int, int] | None:
    """Pixel size from the first bytes of a base64 PNG / GIF / WebP / JPEG; None if unknown."""
    try:
        head = base64.b64decode(data[:44], validate=False)
    except (binascii.Error, ValueError):
        return None
    if head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) >= 24:
        w, h = struct.unpack(">II", head[16:24])
        return int(w), int(h)
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        w, h = struct.unpack("<HH", head[6:10])
        return int(w), int(h)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        return _webp_size(head)
    if head[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return None


def image_tokens(block: Mapping[str, Any]) -> float:
    """Anthropic's ``w*h/750`` after the API's resize (long edge <= 1568, <= 1.15 MP);
    :data:`IMAGE_TOKENS` when the size cannot be read (URL or file sources, odd formats)."""
    source = block.get("source")
    if not isinstance(source, Mapping) or source.get("type") != "base64":
        return float(IMAGE_TOKENS)
    size = image_size(str(source.get("data") or ""))
    if size is None or size[0] <= 0 or size[1] <= 0:
        return float(IMAGE_TOKENS)
    w, h = float(size[0]), float(size[1])
    scale = min(1.0, 1568.0 / max(w, h))
    w, h = w * scale, h * scale
    if w * h > 1_150_000:
        shrink = math.sqrt(1_150_000 / (w * h))
        w, h = w * shrink, h * shrink
    return max(1.0, math.ceil(w * h / 750.0))


# ---------------------------------------------------------------------------------------------
# Message -> base tokens per class
# ---------------------------------------------------------------------------------------------


class ContentVector:
    """Base tokens and characters per content class, and the raw features, of some content."""

    __slots__ = ("chars", "features", "tokens")

    def __init__(self) -> None:
        self.tokens = [0.0] * len(CLASSES)
        self.chars = [0.0] * len(CLASSES)
        self.features = [0.0] * len(FEATURES)

    def add(self, other: ContentVector) -> None:
        """Accumulate ``other`` into this vector."""
        for i in range(len(CLASSES)):
            self.tokens[i] += other.tokens[i]
            self.chars[i] += other.chars[i]
        for i in range(len(FEATURES)):
            self.features[i] += other.features[i]


def _add_text(vec: ContentVector, text: str, kind: TextKind, weights: Sequence[float]) -> None:
    if not text:
        return
    stats = text_stats(text)
    ci = CLASS_INDEX[text_class(text, stats, kind=kind)]
    base = sum(w * f for w, f in zip(weights, stats.features, strict=True))
    # never below 12 chars/token: the negative blank-run weight must not price text at ~0
    vec.tokens[ci] += max(base, stats.chars / 12.0)
    vec.chars[ci] += stats.chars
    for i, f in enumerate(stats.features):
        vec.features[i] += f


def _add_media(vec: ContentVector, block: Mapping[str, Any], weights: Sequence[float]) -> None:
    if block.get("type") == "document":
        source = block.get("source")
        if isinstance(source, Mapping) and source.get("type") == "text":
            _add_text(vec, str(source.get("data") or ""), "text", weights)
            return
        vec.tokens[CLASS_INDEX["media"]] += IMAGE_TOKENS  # PDFs and the like: no cheap size
        return
    vec.tokens[CLASS_INDEX["media"]] += image_tokens(block)


def content_vector(message: Message, weights: Sequence[float]) -> ContentVector:
    """Base tokens per class of one message's content; ``weights`` in :data:`FEATURES` order."""
    vec = ContentVector()
    tool_block = weights[_F["tool_blocks"]]
    for seg in iter_segments(message):
        if seg.kind == "media":
            if seg.block is not None:
                _add_media(vec, seg.block, weights)
            continue
        if seg.kind in ("tool_use", "tool_result"):  # ids (sent twice) and block wrappers
            vec.tokens[CLASS_INDEX["structure"]] += tool_block
            vec.features[_F["tool_blocks"]] += 1.0
        _add_text(vec, seg.text, _text_kind(seg), weights)
    return vec


def _text_kind(seg: Segment) -> TextKind:
    if seg.kind == "thinking":
        return "thinking"
    if seg.kind in ("tool_use", "other"):  # tool inputs and unknown blocks are JSON
        return "json"
    return "error" if seg.error else "text"
