"""The C allocator set for a server whose request bodies grow a little every call (glibc only).

A conversation re-sends its whole history each call, so each body is a little larger than the
last. glibc takes a block past its mmap threshold from the system with ``mmap`` and gives it
back on ``free``; the threshold follows the largest block freed so far, so a body larger than
every earlier one -- the next call of a growing conversation -- is always past it: each call's
few body-sized buffers (the bytes read, their join, what is written) came as fresh pages, each
page a fault. At 10,000 messages (~11 MB a body) the proxy took 550-2,200 page faults a call
and 8-13 ms of CPU; with the thresholds fixed, 4-10 faults and 7.7-9.3 ms (one run each,
against the same proxy beside it). The heap keeps what it frees up to
:data:`KEEP_FREED` instead: the resident size after a burst of large bodies stays near its peak
(16 conversations of 1,000 messages: +1 MiB; 2 of 10,000: +7.5 MiB), never above it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

__all__ = ["HEAP_BLOCKS", "KEEP_FREED", "tune_allocator"]

HEAP_BLOCKS = 32 * 2**20
"""Blocks up to this size come from the heap, not from ``mmap``: glibc's largest allowed
threshold on 64-bit systems (32 MiB, the API's own limit of a request body)."""
KEEP_FREED = 2 * HEAP_BLOCKS
"""Free memory at the heap's top kept rather than given back: twice :data:`HEAP_BLOCKS`, as
glibc's own rule sets it when it moves the threshold."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds at :data:`HEAP_BLOCKS` and :data:`KEEP_FREED` (see
    the module) for this process. True when they were set; False, and nothing changed, where
    the C library is not glibc (musl, macOS, Windows) or refuses a value (a 32-bit system)."""
    if not _on_glibc():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either one turns glibc's moving thresholds off, and
    # one alone would leave the mmap threshold at 128 KiB (every body from mmap)
    if not mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED))


def _on_glibc() -> bool:
    version = ""
    with contextlib.suppress(AttributeError, ValueError, OSError):  # not a GNU system
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    return version.startswith("glibc ")
