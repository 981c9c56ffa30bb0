"""Forced-sequence accuracy of the KV cache types: chosen-token |Δlogprob| against fp32 KV (CPU).

  .venv/bin/python tools/cpu/kv_accuracy.py --gguf small-2L.gguf [--len 512] [--dtypes fp16,bf16,q8_0]
      [--matmul exact] [--chunk 0]
A sequence of `--len` pseudo-random ids (seed `--seed`) is scored teacher-forced by swaserve's model once
per `--kv-cache-dtype`, every run with the same `--cpu-matmul` (default exact: the only difference between
the runs is the KV storage); logprob = log_softmax(fp32 logits in float64)[next id]. The reference is the
fp32-KV run. `--chunk N` scores in prefill chunks of N tokens (each chunk reads the earlier ones' KV back
from the pool, as a cached prefix does); 0 = one prefill (its keys are stored, then read, all the same).
Prints, per type, its bytes per token and median / p90 / max |Δ| and the top-1 agreement against fp32.
The same method as tools/cpu/accuracy.py (docs/benchmarks.md); use a shallow cut of a random preset
(tools/models/trunc_gguf.py), the full random presets are chaotic.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch


def score(path: str | None, kv: str, ids: list[int], matmul: str, threads: int, chunk: int
          ) -> tuple[list[float], list[int], tuple[int, int]]:
    """(chosen-token logprobs [len - 1], argmax ids [len - 1], bytes per full / SWA token) with KV `kv`."""
    from swaserve.engine.runner.model_runner import build_metadata
    from swaserve.llm import LLM

    n = len(ids)
    step = chunk or n
    room = n + max(512, step) + 256  # every position's KV of both kinds at once (no SWA eviction)
    llm = LLM(path, cpu_matmul=matmul, kv_cache_dtype=kv, cpu_threads=threads, cache_type="naive",
              device="cpu", max_running_requests=1, chunked_prefill_size=max(512, step),
              max_total_tokens=room, swa_tokens=room)
    eng = llm.engine
    model, pool, page = eng.runner.model, eng.pool, eng.config.cache.page_size
    pages = list(range(-(-n // page)))
    req = SimpleNamespace(full_pages=pages, swa_pages=pages)
    rows = []
    with torch.no_grad():
        for start in range(0, n, step):
            q = min(step, n - start)
            batch = SimpleNamespace(reqs=[req], prefix_lens=[start], q_lens=[q])
            meta = build_metadata(batch, page, eng.model_config.sliding_window)
            hidden = model.forward(torch.tensor(ids[start:start + q]), meta, pool)  # [q, H]
            rows.append(model.logits(hidden).double())  # [q, V]
    logits = torch.cat(rows)  # [n, V]
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    per_token = pool.bytes_per_token()
    llm.close()
    return chosen.tolist(), logits[:-1].argmax(-1).tolist(), per_token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=None, help="a Gemma 4 GGUF (default: the built-in tiny demo model)")
    p.add_argument("--dtypes", default="fp16,bf16,q8_0", help="KV types compared with fp32, comma-separated")
    p.add_argument("--matmul", default="exact", choices=["exact", "native", "fast"],
                   help="--cpu-matmul of every run")
    p.add_argument("--len", type=int, default=512, help="sequence length (scored positions = len - 1)")
    p.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the whole sequence at once)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    r = random.Random(args.seed)
    ids = [2] + [r.randint(300, 2999) for _ in range(args.len - 1)]
    res = {}
    for kv in ["fp32", *[d for d in args.dtypes.split(",") if d and d != "fp32"]]:
        t0 = time.monotonic()
        res[kv] = score(args.gguf, kv, ids, args.matmul, args.threads, args.chunk)
        print(f"scored with KV {kv} in {time.monotonic() - t0:.1f}s", flush=True)
    ref, ref_top, _ = res["fp32"]
    n = len(ref)
    how = f"chunks of {args.chunk}" if args.chunk else "one prefill"
    print(f"\n{args.gguf or 'tiny demo model'}: {args.len} pseudo-random ids (seed {args.seed}), {n} scored "
          f"positions, {how}, --cpu-matmul {args.matmul}; reference = fp32 KV; mean chosen logprob "
          f"{sum(ref) / n:.2f}\n")
    print("| KV dtype | bytes / token (full, SWA) | median abs Δlogprob | p90 | max | top-1 agrees with "
          "fp32 |")
    print("|---|---|---|---|---|---|")
    for kv, (lp, top, (full_b, swa_b)) in res.items():
        if kv == "fp32":
            continue
        d = sorted(abs(a - b) for a, b in zip(lp, ref))
        agree = sum(a == b for a, b in zip(top, ref_top)) / n
        p90 = d[int(0.9 * (n - 1))]
        print(f"| {kv} | {full_b}, {swa_b} | {statistics.median(d):.2e} | {p90:.2e} | {d[-1]:.2e} | "
              f"{agree:.1%} |")


if __name__ == "__main__":
    main()
