"""Q4_0 matmul benchmark on the real gemma-4-26B-A4B projection and expert shapes.

`python -m tools.cpu.quant_matmul [--rows 1,8,128] [--device cpu|cuda] [--threads N] [--lm-head]` prints,
per shape and row count, the best time per call of our Q4_0 linear (engine.quant.linear; on CPU both the exact
fp32 path and the bf16 int4-kernel path) against an fp32 dense matmul on the dequantized weight,
and the bytes-read bounds: Q4_0 weight bytes / memory bandwidth and fp32 weight bytes / bandwidth
(bandwidth measured with a large tensor copy, counting bytes read + written).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from swaserve.engine.quant.base import Q4_0_BLOCK_BYTES, WEIGHTS_PER_BLOCK, QWeight
from swaserve.engine.quant.dequant import dequantize
from swaserve.engine.quant.linear import linear

HIDDEN = 2816
# (name, K in, N out) of gemma-4-26B-A4B
SHAPES: list[tuple[str, int, int]] = [
    ("q_proj sliding", HIDDEN, 16 * 256),
    ("k_proj sliding", HIDDEN, 8 * 256),
    ("o_proj sliding", 16 * 256, HIDDEN),
    ("q_proj full", HIDDEN, 16 * 512),
    ("k_proj full", HIDDEN, 2 * 512),
    ("o_proj full", 16 * 512, HIDDEN),
    ("dense gate / up", HIDDEN, 2112),
    ("dense down", 2112, HIDDEN),
    ("expert gate_up", HIDDEN, 2 * 704),
    ("expert down", 704, HIDDEN),
]
LM_HEAD = ("lm_head (tied embed)", HIDDEN, 262144)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object], device: torch.device, min_time: float = 0.3, max_iters: int = 200
) -> float:
    """Best (minimum) seconds per call over repeats, after one warm-up call that also builds the
    lazy caches; the minimum is the figure least disturbed by other processes."""
    fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def bandwidth(device: torch.device, nbytes: int = 1 << 29) -> float:
    """Bytes/s of a large copy (read + write counted), the memory-bound ceiling."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    b = torch.empty_like(a)
    t = time_call(lambda: b.copy_(a), device, min_time=0.5, max_iters=20)
    return 2 * nbytes / t


def random_q4_0(n: int, k: int, seed: int = 0) -> QWeight:
    """A random Q4_0 weight [N, K] (random codes, scales ~ 1/sqrt(K))."""
    rng = np.random.default_rng(seed)
    nb = k // WEIGHTS_PER_BLOCK
    blocks = rng.integers(0, 256, size=(n, nb, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(n, nb)) / (4.6 * k**0.5)).astype(np.float16)
    blocks[..., :2] = d[..., None].view(np.uint8).reshape(n, nb, 2)
    return QWeight("Q4_0", (n, k), torch.from_numpy(blocks.reshape(n, nb * Q4_0_BLOCK_BYTES)), "bench")


def run(rows: list[int], device: torch.device, lm_head: bool = False, out=sys.stdout) -> list[dict]:
    """Benchmark every shape at every row count; print a markdown table; return the rows."""
    bw = bandwidth(device)
    print(
        f"device {device}, threads {torch.get_num_threads()}, copy bandwidth {bw / 1e9:.1f} GB/s "
        "(read + write)",
        file=out,
    )
    cpu = device.type == "cpu"
    cols = ["shape (K -> N)", "rows", "Q4_0 fp32 ms" if cpu else "Q4_0 ms"]
    cols += ["Q4_0 bf16 ms"] if cpu else []
    cols += ["fp32 dense ms", "Q4_0 bound ms", "fp32 bound ms"]
    print("| " + " | ".join(cols) + " |", file=out)
    print("|" + "---|" * len(cols), file=out)
    results = []
    for name, k, n in SHAPES + ([LM_HEAD] if lm_head else []):
        for r in _bench_shape(name, k, n, rows, device, bw):
            results.append(r)
            vals = [f"{name} ({k} -> {n})", str(r["rows"]), f"{r['q4_fp32'] * 1e3:.3f}"]
            vals += [f"{r['q4_bf16'] * 1e3:.3f}"] if cpu else []
            vals += [f"{r[c] * 1e3:.3f}" for c in ("dense", "q4_bound", "fp32_bound")]
            print("| " + " | ".join(vals) + " |", file=out, flush=True)
    return results


def _bench_shape(
    name: str, k: int, n: int, rows: list[int], device: torch.device, bw: float
) -> Iterator[dict]:
    w = random_q4_0(n, k)
    wd = dequantize(w).to(device)  # [N, K] fp32: the dense baseline
    if device.type != "cpu":
        w = QWeight(w.qtype, w.shape, w.data.to(device), w.name)
    q4_bytes = n * k // WEIGHTS_PER_BLOCK * Q4_0_BLOCK_BYTES
    for m in rows:
        x = torch.randn(m, k, device=device)
        xb = x.bfloat16()
        r: dict = {"shape": name, "k": k, "n": n, "rows": m}
        r["q4_fp32"] = time_call(lambda: linear(x, w), device)  # noqa: B023
        if device.type == "cpu":
            r["q4_bf16"] = time_call(lambda: linear(xb, w), device)  # noqa: B023
        r["dense"] = time_call(lambda: torch.mm(x, wd.t()), device)  # noqa: B023
        r["q4_bound"] = q4_bytes / bw
        r["fp32_bound"] = n * k * 4 / bw
        yield r


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="1,8,128", help="comma-separated row counts (default 1,8,128)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    p.add_argument("--lm-head", action="store_true", help="also the 262144 x 2816 tied lm_head (3 GB fp32)")


def run_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        raise ValueError(f"--rows {args.rows!r}: expected comma-separated integers") from None
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available")
    run(rows, device, lm_head=args.lm_head)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cpu.quant_matmul", description=__doc__)
    add_bench_args(p)
    return run_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
