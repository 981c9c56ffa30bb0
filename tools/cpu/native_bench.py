"""The native Q4_0 x Q8_0 matmul against the same kernel at another git revision, side by side in one run.

  OMP_NUM_THREADS=1 .venv/bin/python tools/cpu/native_bench.py [--baseline-rev main] [--shapes 2816x2816,...]
      [--ms 1,4,8,32,128] [--cold] [--no-vnni]
The baseline's engine/quant/native_q4.c (`git show REV:...`) is compiled with the same flags into a
temporary directory and called through the entry points every revision has (swa_q4_packed_bytes,
swa_q4_repack, swa_q4_mm); each weight is repacked by its own library. Times are the CPU time of this
thread (1 thread: robust on a busy machine). --cold cycles through ~256 MB of copies of the weight so that
it streams from DRAM as in decode; otherwise it stays in cache. Prints a table of ms per call and GOP/s.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from swaserve.engine.quant import native

ROOT = Path(__file__).resolve().parents[2]


def _baseline(rev: str, tmp: Path) -> ctypes.CDLL:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:engine/quant/native_q4.c"], check=True,
                         capture_output=True).stdout
    (tmp / "base.c").write_bytes(src)
    headers = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "engine/quant/"],
                             check=True, capture_output=True, text=True).stdout.split()
    for h in (h for h in headers if h.endswith(".h")):  # the revision's headers native_q4.c may include
        hdr = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{h}"], check=True, capture_output=True)
        (tmp / Path(h).name).write_bytes(hdr.stdout)
    out = str(tmp / "base.so")
    subprocess.run(["gcc", *native.CFLAGS, "-o", out, str(tmp / "base.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(tmp / "base.so"))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.swa_q4_packed_bytes.argtypes, lib.swa_q4_packed_bytes.restype = [i64, i64], i64
    lib.swa_q4_repack.argtypes, lib.swa_q4_repack.restype = [ptr, i64, i64, ptr, i32], None
    lib.swa_q4_mm.argtypes, lib.swa_q4_mm.restype = [ptr, i64, i64, ptr, i64, ptr, i32], None
    return lib


def _time(lib: ctypes.CDLL, raw: torch.Tensor, n: int, k: int, m: int, cold: bool) -> float:
    packed = torch.empty(lib.swa_q4_packed_bytes(n, k), dtype=torch.uint8)
    lib.swa_q4_repack(raw.data_ptr(), n, k, packed.data_ptr(), 1)
    n_copies = max(1, (256 << 20) // packed.numel()) if cold else 0
    copies = [packed] + [packed.clone() for _ in range(n_copies)]
    x = torch.randn(m, k)
    y = torch.empty(m, n)
    reps = max(len(copies), min(200, int(3e8 // (n * k * m)) + 3))
    for w in copies[:3]:
        lib.swa_q4_mm(x.data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(), 1)
    t0 = time.thread_time()
    for i in range(reps):
        lib.swa_q4_mm(x.data_ptr(), m, k, copies[i % len(copies)].data_ptr(), n, y.data_ptr(), 1)
    return (time.thread_time() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-rev", default="main")
    p.add_argument("--shapes", default="2816x2816,1408x2816,2816x704", help="NxK weights (N outputs)")
    p.add_argument("--ms", default="1,4,8,32,128", help="activation rows")
    p.add_argument("--cold", action="store_true", help="weights stream from DRAM (many copies)")
    p.add_argument("--no-vnni", action="store_true", help="the new kernel built without VNNI (maddubs path)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cur = native.load()
    if cur is None:
        raise SystemExit(f"native kernels unavailable: {native.why_unavailable()}")
    if args.no_vnni:
        cur = native.build_variant(("-mno-avxvnni", "-mno-avx512vnni"))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = _baseline(args.baseline_rev, Path(tmp))
        print(f"baseline {args.baseline_rev} vs working tree (VNNI: {bool(cur.swa_q4_vnni())}), 1 thread, "
              f"{'cold' if args.cold else 'warm'} weights")
        print("| N x K | M | baseline ms | new ms | baseline GOP/s | new GOP/s | speedup |")
        print("|---|---|---|---|---|---|---|")
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            raw = torch.from_numpy(quants.quantize(w, GGMLQuantizationType.Q4_0)).contiguous()
            for m in map(int, args.ms.split(",")):
                tb, tn = _time(base, raw, n, k, m, args.cold), _time(cur, raw, n, k, m, args.cold)
                ops = 2 * n * k * m / 1e9
                print(f"| {n} x {k} | {m} | {tb * 1e3:.3f} | {tn * 1e3:.3f} | {ops / tb:.0f} | "
                      f"{ops / tn:.0f} | {tb / tn:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
