"""Batch-1 Q4_0 matmul (the decode step's gemv) from DRAM: GB/s of weights streamed, beside a plain read.

A working set larger than the last-level cache (the layers of one decode step do not stay cached), one
activation row, one thread by default; each build in --flags (extra compiler flags of the native kernels,
e.g. "-DPF1_BLOCKS=24") is timed round-robin with the default build, best of --reps:

    OMP_NUM_THREADS=1 python tools/cpu/gemv_bench.py --k 1024 --mb 96
    OMP_NUM_THREADS=1 python tools/cpu/gemv_bench.py --k 2816 --mb 256 --flags=-DPF1_BLOCKS=64
"""

from __future__ import annotations

import argparse
import time

import torch

from swaserve.engine.quant import native


def weights(k: int, mb: float, shapes: list[int]) -> list[tuple[torch.Tensor, int]]:
    """Random interleaved Q4_0 weights [n, k] for n in `shapes`, cycled until they hold `mb` MB."""
    out: list[tuple[torch.Tensor, int]] = []
    total, i = 0, 0
    gen = torch.Generator().manual_seed(0)
    while total < mb * 1e6:
        n = shapes[i % len(shapes)]
        raw = torch.randint(0, 256, (n, k // 32 * 18), dtype=torch.uint8, generator=gen)
        raw.view(n, k // 32, 18)[:, :, 1] = 0x2C  # fp16 scales ~0.06: finite outputs
        out.append((native.repack(raw, n, k), n))
        total += out[-1][0].numel()
        i += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=1024, help="input width (a multiple of 32)")
    p.add_argument("--shapes", default="1024,512,512,1024,1024,1024,1024",
                   help="output rows of the weights, cycled (default: small's q, k, v, o, gate, up, down)")
    p.add_argument("--mb", type=float, default=96.0, help="working set in MB (beyond the L3)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--flags", action="append", default=[], help="another build's extra flags (repeatable)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ws = weights(args.k, args.mb, [int(s) for s in args.shapes.split(",")])
    total = sum(w.numel() for w, _ in ws)
    x = torch.randn(1, args.k)
    builds = {"default": native.load()} | {f: native.build_variant(tuple(f.split())) for f in args.flags}
    flat = torch.cat([w.view(-1) for w, _ in ws]).view(torch.int64)
    best = dict.fromkeys([*builds, "plain read"], float("inf"))
    for _ in range(args.reps):
        for name, lib in builds.items():
            t = time.perf_counter()
            for w, n in ws:
                native.mm(x, w, n, args.threads, lib=lib)
            best[name] = min(best[name], time.perf_counter() - t)
        t = time.perf_counter()
        flat.sum()
        best["plain read"] = min(best["plain read"], time.perf_counter() - t)
    print(f"{len(ws)} weights [n, {args.k}], {total / 1e6:.1f} MB, {args.threads} thread(s), "
          f"best of {args.reps}")
    print("| build | ms | GB/s | / plain read |\n|---|---|---|---|")
    for name, s in best.items():
        print(f"| {name} | {s * 1e3:.2f} | {total / s / 1e9:.2f} | {best['plain read'] / s:.2f} |")


if __name__ == "__main__":
    main()
