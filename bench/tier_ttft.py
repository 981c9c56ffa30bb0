"""Time to first token of a prefix promoted from the second KV tier vs its prefill, side by side in one run.

    python -m swaserve.bench.tier_ttft --model small.gguf --prefix-len 4096 [--threads 1]

Steps, through the offline API (swaserve.llm.LLM, `--kv-offload-dir` in a temporary directory):
  1. prefill: prefix + question 1 on an empty cache (max_tokens=1: the time is the time to first token);
  2. everything is evicted from the KV arena (written to the tier), the tier file is synced and its pages
     dropped from the OS page cache (posix_fadvise DONTNEED), so the promotion reads the disk;
  3. promoted: prefix + question 2: the prefix comes back from the tier, only the question is computed;
  4. recomputed: the same with the tier cleared (flush), for the ratio at equal prompt length.
Wall and process CPU seconds are printed for each; the ratios use both. The tier's bytes per token and the
disk bandwidth seen while promoting give an estimate for other geometries (--estimate-preset).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from swaserve.engine.core import SamplingParams


def _timed(llm, prompt: list[int]) -> tuple[float, float, int]:
    t0, c0 = time.perf_counter(), time.process_time()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0, time.process_time() - c0, out.cached_tokens


def _drop_page_cache(tier) -> None:
    io = tier.io
    io.mm.flush()
    os.posix_fadvise(io.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m swaserve.bench.tier_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    p.add_argument("--cpu-matmul", default="native")
    p.add_argument("--offload-dir", default=None, help="tier directory (default: a temporary one)")
    p.add_argument("--offload-gb", type=float, default=2.0)
    p.add_argument("--estimate-preset", default="26b-a4b",
                   help="model preset whose promotion time is estimated from the measured bandwidth")
    args = p.parse_args(argv)
    from swaserve.engine.attention.kv_pool import bytes_per_token, resolve_kv_dtype
    from swaserve.llm import LLM
    from swaserve.models.tiny import preset_config

    tmp = tempfile.TemporaryDirectory(prefix="swaserve-tier-") if args.offload_dir is None else None
    kw = dict(kv_offload_dir=args.offload_dir or tmp.name, kv_offload_gb=args.offload_gb,
              cpu_matmul=args.cpu_matmul)
    if args.threads:
        kw["cpu_threads"] = args.threads
    print("loading ...", file=sys.stderr, flush=True)
    llm = LLM(args.model, **kw)
    eng = llm.engine
    tier = eng.tier
    rng = random.Random(0)
    V = llm.tokenizer.vocab_size
    prefix = [2] + [rng.randrange(3, V) for _ in range(args.prefix_len - 1)]
    qs = [[rng.randrange(3, V) for _ in range(args.question_len)] for _ in range(3)]
    print("warm-up ...", file=sys.stderr, flush=True)
    _timed(llm, [2] + [rng.randrange(3, V) for _ in range(args.question_len * 4)])
    eng.flush_cache()
    print("1/3 prefill ...", file=sys.stderr, flush=True)
    pre = _timed(llm, prefix + qs[0])
    eng.cache.evict_full(10**9)  # every page leaves the arena for the tier
    st0 = tier.stats()
    _drop_page_cache(tier)
    print("2/3 promoted ...", file=sys.stderr, flush=True)
    promo = _timed(llm, prefix + qs[1])
    st1 = tier.stats()
    read_bytes = st1["bytes_read"] - st0["bytes_read"]
    read_s = st1["read_seconds"] - st0["read_seconds"]
    eng.flush_cache()
    print("3/3 recomputed ...", file=sys.stderr, flush=True)
    rec = _timed(llm, prefix + qs[2])
    full_b, swa_b = bytes_per_token(eng.model_config, eng.pool.dtype)
    W = eng.model_config.sliding_window
    print(f"model {eng.model_name}, prefix {args.prefix_len} + question {args.question_len} tokens, "
          f"KV {str(eng.pool.dtype).removeprefix('torch.')}, threads {args.threads or 'all'}")
    print(f"{'request':<26}{'wall s':>9}{'CPU s':>9}{'cached':>8}")
    for name, (w, c, cached) in (("prefill (empty cache)", pre), ("promoted from the tier", promo),
                                 ("recomputed (tier flushed)", rec)):
        print(f"{name:<26}{w:>9.3f}{c:>9.3f}{cached:>8d}")
    print(f"promoted / prefill: wall {promo[0] / pre[0]:.3f}, CPU {promo[1] / pre[1]:.3f}; "
          f"promoted / recomputed: wall {promo[0] / rec[0]:.3f}, CPU {promo[1] / rec[1]:.3f}")
    bw = read_bytes / read_s if read_s > 0 else float("nan")
    print(f"tier read {read_bytes / 2**20:.1f} MiB in {read_s:.3f} s ({bw / 2**20:.0f} MiB/s from a dropped "
          f"page cache, checksums included) for {promo[2]} tokens: {full_b} B full + {swa_b} B SWA per "
          f"token, SWA only for the last {W}; written while evicting: "
          f"{st0['bytes_written'] / 2**20:.1f} MiB in {st0['write_seconds']:.3f} s")
    est_cfg = preset_config(args.estimate_preset)
    ef, es = bytes_per_token(est_cfg, resolve_kv_dtype("bf16", eng.device))
    est_bytes = args.prefix_len * ef + min(args.prefix_len, est_cfg.sliding_window) * es
    print(f"estimate for {args.estimate_preset} (bf16 KV): a {args.prefix_len}-token prefix is "
          f"{est_bytes / 2**20:.0f} MiB ({ef} B full + {es} B SWA per token): {est_bytes / bw:.2f} s at the "
          f"{bw / 2**20:.0f} MiB/s seen here")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
