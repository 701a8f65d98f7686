"""What an image or document costs: its pixel size, read off the base64 header."""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Mapping
from typing import Any

from pipeline.wire.deferred import resolved

__all__ = ["IMAGE_TOKENS", "image_size", "image_tokens"]

IMAGE_TOKENS = 2_000
"""Fixed estimate for an image or document block: base64 length says nothing about
tokens. The calibrated estimator falls back to it for images it cannot size and for non-text
documents."""


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
    size = image_size(str(resolved(source.get("data")) or ""))
    if size is None or size[0] <= 0 or size[1] <= 0:
        return float(IMAGE_TOKENS)
    w, h = float(size[0]), float(size[1])
    scale = min(1.0, 1568.0 / max(w, h))
    w, h = w * scale, h * scale
    if w * h > 1_150_000:
        shrink = math.sqrt(1_150_000 / (w * h))
        w, h = w * shrink, h * shrink
    return max(1.0, math.ceil(w * h / 750.0))
