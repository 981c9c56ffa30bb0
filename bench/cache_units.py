"""A user's units for the cache benchmark's pools (bench/cache_sim.py): GiB of gemma-4-26B-A4B KV and total
windows.

A pool of the simulation is `full` full-attention pages and `swa` SWA pages of `page_size` tokens. Its memory
is what the engine's arena would take for it with a KV storage type (`--kv-cache-dtype`): an SWA token
costs 10 full tokens on Gemma 4, so the split pools and the arena of the same pages take the same bytes.
Its total windows are its SWA tokens / window: what the running requests hold (each its window plus two
pages, and a prefill chunk) included, where `--windows N` counts only the N windows of cache beyond them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# K and V bytes of one token of gemma-4-26B-A4B (full layers, sliding layers) per KV storage type: 5 full
# layers of 2 KV heads x 512, 25 sliding layers of 8 KV heads x 256; q8_0 = 34 bytes per 32 values
# (engine/attention/kv_pool.py bytes_per_token; tests/bench/test_cache_units.py checks them against it)
KV_BYTES_PER_TOKEN: dict[str, tuple[int, int]] = {"bf16": (20480, 204800), "fp16": (20480, 204800),
                                                   "fp32": (40960, 409600), "q8_0": (10880, 108800)}
SHOWN = ("bf16", "q8_0")  # the GiB columns every row prints
GIB = 1 << 30
ROOMY = "roomy"  # a pool that holds every trace's KV
GIB_SUFFIX = "GiB"  # a pool size "<G>GiB" (--kv-cache-memory-gb)


def pool_bytes(full_pages: int, swa_pages: int, page_size: int, kv_type: str = "bf16") -> int:
    """Bytes of KV the pools hold with storage type kv_type (bf16 or q8_0)."""
    full, swa = KV_BYTES_PER_TOKEN[kv_type]
    return page_size * (full_pages * full + swa_pages * swa)


def pages_for_memory(gib: float, page_size: int, full_per_swa: int, kv_type: str) -> tuple[int, int]:
    """(full pages, SWA pages) of split pools (full tokens = full_per_swa x SWA tokens) in `gib` GiB of
    kv_type KV: what `--kv-cache-memory-gb` would give the engine."""
    full, swa = KV_BYTES_PER_TOKEN[kv_type]
    swa_pages = int(gib * GIB // (page_size * (swa + full_per_swa * full)))
    return full_per_swa * swa_pages, swa_pages


def describe(full_pages: int, swa_pages: int, page_size: int, window: int) -> dict[str, float]:
    """The pool in a user's units: total windows, GiB of bf16 and of q8_0 KV."""
    return {"total_windows": round(swa_pages * page_size / window, 2),
            **{f"gib_{t}": round(pool_bytes(full_pages, swa_pages, page_size, t) / GIB, 3)
               for t in SHOWN}}


def kv_page_scale(kv_type: str) -> float:
    """Pages of kv_type in the bytes of one bf16 page (bf16 and fp16 1, fp32 0.5, q8_0 2 / 1.0625)."""
    return KV_BYTES_PER_TOKEN["bf16"][1] / KV_BYTES_PER_TOKEN[kv_type][1]


def parse_windows(text: str) -> list[int | str]:
    out: list[int | str] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        if x == ROOMY:
            out.append(x)
        elif x.isdigit() and int(x) > 0:
            out.append(int(x))
        else:
            raise argparse.ArgumentTypeError(f"--windows: expected positive integers or 'roomy', got {x!r}")
    return out


def parse_gib(text: str) -> list[str]:
    out: list[str] = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            ok = float(x) > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"--kv-cache-memory-gb: expected positive numbers, got {x!r}")
        out.append(f"{x}{GIB_SUFFIX}")
    return out


def parse_choices(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{flag}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
    return items
