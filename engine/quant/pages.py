"""Dropping the resident pages of a read-only file mapping (after a weight was repacked elsewhere)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_libc = None


def release_pages(t: torch.Tensor) -> bool:
    """madvise(DONTNEED) the whole pages inside a CPU tensor that views a *read-only shared file
    mapping* (the loader marks such QWeights); the data stays valid and is re-read from the file on
    the next access. Never call this on anonymous memory (it would zero it). Returns True if done."""
    global _libc
    if t.is_cuda or not sys.platform.startswith("linux") or t.numel() == 0 or not t.is_contiguous():
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        page = mmap.PAGESIZE
        a, b = -(-start // page) * page, end // page * page
        if b <= a:
            return False
        return _libc.madvise(a, b - a, _MADV_DONTNEED) == 0
    except (OSError, AttributeError) as e:  # pragma: no cover - platform specific
        log.debug("madvise unavailable: %s", e)
        return False
