"""Time to first token of a prefix promoted from the second KV tier (host level, file, fetched while queued)
vs its prefill, and the step's stall while evicting it (write-behind vs synchronous), side by side in one run.

    python -m tools.cache.tier_ttft --model small.gguf --prefix-len 4096 [--threads 1] [--host-gb 1]

Steps, through the engine (`--kv-offload-dir` in a temporary directory, `--kv-offload-host-gb --host-gb`):
  1. prefill: prefix + question 1 on an empty cache (max_tokens=1: the time is the time to first token);
     then every page is evicted from the KV arena: the eviction's time is the step's stall (the pages are
     copied into host frames), the background writer then seals them into the file (timed apart);
  2. promoted from the host level: prefix + question 2 (the frames are still there: plain copies);
  3. promoted from the file: evicted again, frames dropped, the file's pages dropped from the OS page cache
     (posix_fadvise DONTNEED), background fetches off; the admission reads and verifies the records itself
     (what happens when a fetch has not started by admission);
  4. fetched while queued: the same, but the request is queued first and its records are fetched into the
     host level in the background before it is admitted (the time counts from admission);
  5. recomputed: the same prompt length with the tier flushed; then the tier is switched to synchronous
     writes (the file alone, as before the host level: a fresh, sparse file like step 1's) and the prefix
     evicted again: the step's stall then. "in write s" is the part of the stall spent in the tier's
     write calls (the rest walks the tree); "writer s" the background thread's time for the same bytes.
Wall and process CPU seconds are printed; the ratios use both. The bytes per token and the bandwidths seen
give an estimate for another geometry (--estimate-preset).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from swaserve.engine.core import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _timed(llm, prompt: list[int]) -> tuple[float, float, int]:
    t0, c0 = time.perf_counter(), time.process_time()
    (out,) = llm.generate([prompt], ONE)
    return time.perf_counter() - t0, time.process_time() - c0, out.cached_tokens


def _timed_queued(eng, io, prompt: list[int]) -> tuple[float, float, int]:
    """Queue the request, let the background fetch finish (the request waited in the queue), then admit."""
    eng.add_request("tier-ttft-queued", prompt, ONE)
    io.drain()
    t0, c0 = time.perf_counter(), time.process_time()
    cached = -1
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                cached = o.cached_tokens
    return time.perf_counter() - t0, time.process_time() - c0, cached


def _drop_page_cache(disk) -> None:
    disk.mm.flush()
    os.posix_fadvise(disk.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _evict(eng) -> tuple[float, float]:
    """Evict every cached page (as make_room does inside a step); (wall, CPU) seconds of the eviction."""
    t0, c0 = time.perf_counter(), time.process_time()
    eng.cache.evict_full(10**9)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cache.tier_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    p.add_argument("--cpu-matmul", default="native")
    p.add_argument("--offload-dir", default=None, help="tier directory (default: a temporary one)")
    p.add_argument("--offload-gb", type=float, default=2.0)
    p.add_argument("--host-gb", type=float, default=1.0, help="the tier's host level (--kv-offload-host-gb)")
    p.add_argument("--estimate-preset", default="26b-a4b",
                   help="model preset whose promotion time is estimated from the measured bandwidths")
    args = p.parse_args(argv)
    from swaserve.engine.attention.kv_pool import bytes_per_token, resolve_kv_dtype
    from swaserve.engine.kvcache.tier.file import MmapTierIO
    from swaserve.llm import LLM
    from swaserve.models.demo.tiny import preset_config

    tmp = tempfile.TemporaryDirectory(prefix="swaserve-tier-") if args.offload_dir is None else None
    kw = dict(kv_offload_dir=args.offload_dir or tmp.name, kv_offload_gb=args.offload_gb,
              kv_offload_host_gb=args.host_gb, cpu_matmul=args.cpu_matmul)
    if args.threads:
        kw["cpu_threads"] = args.threads
    print("loading ...", file=sys.stderr, flush=True)
    llm = LLM(args.model, **kw)
    eng = llm.engine
    tier = eng.tier
    io = tier.io
    rng = random.Random(0)
    V = llm.tokenizer.vocab_size
    prefix = [2] + [rng.randrange(3, V) for _ in range(args.prefix_len - 1)]
    qs = [[rng.randrange(3, V) for _ in range(args.question_len)] for _ in range(5)]
    print("warm-up ...", file=sys.stderr, flush=True)
    _timed(llm, [2] + [rng.randrange(3, V) for _ in range(args.question_len * 4)])
    eng.flush_cache()

    def delta(a: dict, b: dict, *keys: str) -> list[float]:
        return [b[k] - a[k] for k in keys]

    print("1/5 prefill, evict (write-behind) ...", file=sys.stderr, flush=True)
    pre = _timed(llm, prefix + qs[0])
    s0 = tier.stats()
    stall_async = _evict(eng)
    t0 = time.perf_counter()
    io.drain()
    drained = time.perf_counter() - t0
    s1 = tier.stats()
    wrote, writer_s, in_write = delta(s0, s1, "bytes_written", "disk_write_seconds", "write_seconds")
    print("2/5 promoted from the host level ...", file=sys.stderr, flush=True)
    host = _timed(llm, prefix + qs[1])
    s2 = tier.stats()
    host_bytes, host_s, host_hits = delta(s1, s2, "bytes_read", "read_seconds", "host_hits")

    def evict_to_disk() -> None:
        _evict(eng)
        io.drain()
        io.drop_frames()
        _drop_page_cache(io.disk)

    print("3/5 promoted from the file ...", file=sys.stderr, flush=True)
    evict_to_disk()
    s3 = tier.stats()
    io.fetch = lambda kind, slot: False  # no background fetch: the admission reads every record itself
    io.pin = lambda kind, slot, owner: None
    disk = _timed(llm, prefix + qs[2])
    del io.fetch, io.pin
    s4 = tier.stats()
    disk_bytes, disk_s, disk_reads = delta(s3, s4, "bytes_read", "read_seconds", "disk_reads")
    print("4/5 fetched while queued ...", file=sys.stderr, flush=True)
    evict_to_disk()
    s5 = tier.stats()
    fetched = _timed_queued(eng, io, prefix + qs[3])
    s6 = tier.stats()
    n_fetched, fetch_s, fetch_hits = delta(s5, s6, "fetched", "fetch_seconds", "host_hits")
    print("5/5 recomputed, evict (synchronous) ...", file=sys.stderr, flush=True)
    eng.flush_cache()
    rec = _timed(llm, prefix + qs[4])
    # the file alone, every page written inside the eviction as before the host level: a fresh file, sparse
    # like step 1's (the tier's index is empty after the flush)
    old = io.detach()
    fresh = tempfile.TemporaryDirectory(prefix="swaserve-tier-sync-")
    tier.io = MmapTierIO(fresh.name, eng.pool, old.num_blocks, old.fp)
    s7 = tier.stats()
    stall_sync = _evict(eng)
    s8 = tier.stats()
    wrote_sync, in_write_sync = delta(s7, s8, "bytes_written", "write_seconds")
    tier.io.close()
    fresh.cleanup()

    full_b, swa_b = bytes_per_token(eng.model_config, eng.pool.kv_format)
    W = eng.model_config.sliding_window
    print(f"model {eng.model_name}, prefix {args.prefix_len} + question {args.question_len} tokens, "
          f"KV {eng.pool.kv_format.name}, threads {args.threads or 'all'}, "
          f"host level {args.host_gb} GiB")
    print(f"{'request (max_tokens 1)':<34}{'wall s':>9}{'CPU s':>9}{'cached':>8}{'/prefill wall':>15}"
          f"{'/prefill CPU':>14}")
    for name, (w, c, cached) in (("prefill (empty cache)", pre), ("promoted from the host level", host),
                                 ("promoted from the file", disk), ("fetched while queued", fetched),
                                 ("recomputed (tier flushed)", rec)):
        print(f"{name:<34}{w:>9.3f}{c:>9.3f}{cached:>8d}{w / pre[0]:>15.3f}{c / pre[1]:>14.3f}")
    print(f"host level: {host_hits:.0f} pages, {host_bytes / 2**20:.1f} MiB copied in {host_s:.3f} s; file: "
          f"{disk_reads:.0f} pages, {disk_bytes / 2**20:.1f} MiB read and verified in {disk_s:.3f} s from a "
          f"dropped page cache; fetch: {n_fetched:.0f} records in {fetch_s:.3f} s in the background, then "
          f"{fetch_hits:.0f} host hits at admission")
    print(f"{'evicting the prefix (in the step)':<34}{'stall wall s':>13}{'stall CPU s':>12}"
          f"{'in write s':>11}{'MiB':>8}{'writer s':>10}")
    print(f"{'synchronous (the file alone)':<34}{stall_sync[0]:>13.3f}{stall_sync[1]:>12.3f}"
          f"{in_write_sync:>11.3f}{wrote_sync / 2**20:>8.1f}{'-':>10}")
    print(f"{'write-behind (host frames)':<34}{stall_async[0]:>13.3f}{stall_async[1]:>12.3f}{in_write:>11.3f}"
          f"{wrote / 2**20:>8.1f}{writer_s:>10.3f}")
    print(f"stall write-behind / synchronous: {stall_async[0] / stall_sync[0]:.3f} wall; the writer sealed "
          f"the records {drained:.3f} s after the eviction returned")
    est_cfg = preset_config(args.estimate_preset)
    ef, es = bytes_per_token(est_cfg, resolve_kv_dtype("bf16", eng.device))
    est = args.prefix_len * ef + min(args.prefix_len, est_cfg.sliding_window) * es
    print(f"per token here: {full_b} B full + {swa_b} B SWA (SWA only for the last {W})")
    for name, nbytes, secs in (("host level", host_bytes, host_s), ("file", disk_bytes, disk_s)):
        bw = nbytes / secs if secs > 0 else float("nan")
        print(f"estimate for {args.estimate_preset} (bf16 KV), {args.prefix_len}-token prefix = "
              f"{est / 2**20:.0f} MiB ({ef} B full + {es} B SWA per token): {est / bw:.2f} s from the {name} "
              f"at the {bw / 2**20:.0f} MiB/s seen here")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
