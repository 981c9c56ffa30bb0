"""Shared pieces of tools/gpu_check/run.py: the shape sets, the result row, the run context."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

REAL = SimpleNamespace(
    num_heads=16,
    kv_heads=(8, 2),
    head_dims=(256, 512),
    window=1024,
    page_size=16,
    prefill=8192,
    context=8192,
    batches=(1, 8, 32),
    hidden=2816,
    intermediate=2112,
    experts=128,
    top_k=8,
    expert_intermediate=704,
    moe_tokens=(1, 8, 32, 2048),
    gemm_rows=2048,
    # (name, N, K): attention projections (sliding / full), dense MLP, tied lm_head
    projections=[
        ("q swa", 4096, 2816),
        ("k swa", 2048, 2816),
        ("o swa", 2816, 4096),
        ("q full", 8192, 2816),
        ("k full", 1024, 2816),
        ("o full", 2816, 8192),
        ("gate/up", 2112, 2816),
        ("down", 2816, 2112),
        ("lm_head", 262144, 2816),
    ],
    # the other block types (tools/gpu_check/quant.py): (name, N, K) with K whole 256-weight blocks,
    # and the MoE shape (experts, hidden, expert intermediate)
    quant_projections=[("q swa", 4096, 2816), ("o swa", 2816, 4096), ("gate/up", 2112, 2816)],
    quant_moe=(128, 2816, 704),
    preset="26b-a4b",
    e2e_prompt=1024,
    e2e_batches=(1, 8),
    e2e_steps=32,
)
TINY = SimpleNamespace(
    num_heads=4,
    kv_heads=(2, 1),
    head_dims=(32, 64),
    window=16,
    page_size=4,
    prefill=70,
    context=50,
    batches=(1, 3),
    hidden=64,
    intermediate=64,
    experts=8,
    top_k=2,
    expert_intermediate=32,
    moe_tokens=(1, 9),
    gemm_rows=40,
    projections=[("q", 96, 64), ("o", 64, 96)],
    quant_projections=[("q", 96, 256)],
    quant_moe=(4, 256, 32),
    preset="tiny",
    e2e_prompt=12,
    e2e_batches=(2,),
    e2e_steps=3,
)


@dataclass
class Row:
    check: str
    shape: str
    status: str  # ok / FAIL / SKIP / info
    err: float | None = None
    ms: float | None = None
    ref_ms: float | None = None
    rate: str = ""
    note: str = ""
    peak: float | None = None  # GiB: max_memory_allocated during the check (CUDA)


class Ctx:
    def __init__(self, dev: Any, quick: bool, budget_s: float, check_timeout: float):
        import torch

        self.torch = torch
        self.dev = dev
        self.cuda = dev.type == "cuda"
        self.quick = quick
        self.deadline = time.monotonic() + budget_s
        self.check_timeout = check_timeout
        self.copy_bw = 0.0  # bytes/s, measured
        self.mm_flops = 0.0  # flop/s, measured bf16 matmul
        self.gen = torch.Generator(device=dev).manual_seed(int(time.time()))
        self.shapes: Any = None  # REAL or TINY, for the checks of tools/gpu_check/quant.py

    def time_ms(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=5 if self.quick else 20, rep=20 if self.quick else 100))
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def bw(self, nbytes: float, ms: float) -> str:
        r = nbytes / (ms * 1e-3)
        pct = f" ({100 * r / self.copy_bw:.0f}% of copy)" if self.copy_bw else ""
        return f"{r / 1e9:.0f} GB/s{pct}"

    def flops(self, n: float, ms: float) -> str:
        r = n / (ms * 1e-3)
        pct = f" ({100 * r / self.mm_flops:.0f}% of mm)" if self.mm_flops else ""
        return f"{r / 1e12:.1f} TFLOP/s{pct}"


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def status(err: float, tol: float, y) -> str:
    return "ok" if err <= tol and not y.isnan().any() else "FAIL"


def linear_row(c: Ctx, w: Any, M: int, linear: Any, label: str, name: str, note: str) -> Row:
    """One linear row: `linear(x, w)` for M random bf16 rows vs fp32 / bf16 torch matmuls on the
    dequantized weight [N, K] (error, then time against bf16 F.linear)."""
    torch = c.torch
    import torch.nn.functional as F

    from swaserve.engine.quant.dequant import dequantize

    N, K = w.shape
    wd = dequantize(w)  # [N, K] fp32, exact
    x = torch.randn(M, K, device=c.dev, dtype=torch.bfloat16, generator=c.gen)
    y = linear(x, w)
    err = rel_err(y, x.float() @ wd.T)
    wb = wd.to(torch.bfloat16)
    del wd
    ms = c.time_ms(lambda: linear(x, w))
    ref_ms = c.time_ms(lambda: F.linear(x, wb))
    nbytes = w.data.nbytes + x.nbytes + M * N * 2
    rate = c.bw(nbytes, ms) if M <= 64 else c.flops(2 * M * N * K, ms)
    kind = "GEMV" if M <= 4 else "GEMM"
    return Row(f"{label} {kind} {name}", f"M{M} N{N} K{K}", status(err, 2e-2, y), err, ms, ref_ms, rate, note)


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)
