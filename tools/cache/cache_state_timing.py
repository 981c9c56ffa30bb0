"""How long the inspector's cache walk (GET /v1/cache/state) holds up the engine, at a given tree size.

    python -m tools.cache.cache_state_timing [--nodes 10000] [--budget-ms 0.5] [--repeat 5]

Builds a SWARadixCache of --nodes nodes through its own API (fan-out over shared prefixes, some SWA pages
evicted, some handles locked), then walks it (1) in one go, as a synchronous call would, and (2) in
slices of --budget-ms, as the engine loops do between steps. Prints one table: the whole walk's time
and, for the sliced walk, the number of slices and the longest slice (the most a step waits), in CPU
time of the walking thread (time.thread_time: what the walk itself costs) and in wall time (which on a
loaded machine also counts the moments the OS ran other processes, as it would during a step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from swaserve.engine.kvcache import PageAllocator, SWARadixCache
from swaserve.engine.kvcache.snapshot import run_slice, walk_state


def build_tree(num_nodes: int, page_size: int = 16, window: int = 1024, seed: int = 0) -> SWARadixCache:
    full_alloc = PageAllocator(num_nodes * 8 + 1024)
    swa_alloc = PageAllocator(num_nodes * 8 + 1024)
    cache = SWARadixCache(page_size, window, full_alloc, swa_alloc)
    rng = random.Random(seed)
    seqs: list[list[int]] = [[]]
    while len(cache._nodes) < num_nodes:
        base = rng.choice(seqs)
        cut = rng.randrange(0, len(base) + 1)
        fresh = [rng.randrange(1000) for _ in range(page_size * rng.randint(1, 6))]
        ids = base[:cut - cut % page_size] + fresh
        pages = len(ids) // page_size
        full, swa = full_alloc.alloc(pages), swa_alloc.alloc(pages)
        if full is None or swa is None:
            raise RuntimeError("pools too small for the tree")
        res = cache.insert(ids, full, swa, prompt_len=len(ids) - page_size, finished=True)
        if rng.random() < 0.01:
            cache.lock(res.handle)  # a few requests in flight
        seqs.append(ids)
    cache.evict_swa(cache.swa_cached // 4)  # tombstones: partly live windows
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--budget-ms", type=float, default=0.5)
    ap.add_argument("--top", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"building a tree of {args.nodes} nodes ...", flush=True)
    cache = build_tree(args.nodes)
    whole, stats_walk, slices, longest_cpu, p99_wall = [], [], [], [], []
    for _ in range(args.repeat):
        t0 = time.thread_time()
        run_slice(walk_state(cache, args.top), None)
        whole.append(time.thread_time() - t0)
        t0 = time.thread_time()
        cache.stats()  # the cache's own full walk (protected-page count), for scale
        stats_walk.append(time.thread_time() - t0)
        walk = walk_state(cache, args.top)
        cpu: list[float] = []
        wall: list[float] = []
        done = False
        while not done:
            t0, w0 = time.thread_time(), time.perf_counter()
            done, _ = run_slice(walk, args.budget_ms / 1e3)
            cpu.append(time.thread_time() - t0)
            wall.append(time.perf_counter() - w0)
        slices.append(len(cpu))
        longest_cpu.append(max(cpu))
        p99_wall.append(sorted(wall)[int(0.99 * (len(wall) - 1))])
    med = statistics.median
    print(f"| nodes | whole walk, CPU ms | cache.stats() walk, CPU ms | slices of {args.budget_ms} ms | "
          "longest slice, CPU ms | p99 slice, wall ms |")
    print("|---|---|---|---|---|---|")
    print(f"| {len(cache._nodes)} | {med(whole) * 1e3:.1f} | {med(stats_walk) * 1e3:.1f} | "
          f"{med(slices):.0f} | "
          f"{med(longest_cpu) * 1e3:.2f} (max of {args.repeat}: {max(longest_cpu) * 1e3:.2f}) | "
          f"{med(p99_wall) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
