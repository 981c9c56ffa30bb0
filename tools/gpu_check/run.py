"""GPU check of the Triton kernels at gemma-4-26B-A4B shapes: correctness vs torch, speed vs torch and
vs the measured memory-bandwidth (copy) and bf16 matmul ceilings, plus an end-to-end decode rate.

    python -m tools.gpu_check.run [--quick] [--budget-s 480] [--out table.md] [--dry-run] [--cpu-smoke]

The checks live in tools/gpu_check/kernels.py (kernels), e2e.py (end to end),
step.py (decode step wall/GPU-busy/launches/graph replay, the largest planned step, offload
host memory and H2D rate, F16-embedding logits, registers/spills of every launched kernel) and
quant.py (the other block types). Every row records max_memory_allocated (peak GiB).

Every check runs in try/except (a failure prints FAIL and the error, the rest go on); checks
past the time budget print SKIP. Exit status: 0 if nothing failed, 1 otherwise. Without CUDA it
prints a message and exits 0; `--cpu-smoke` runs the same checks at tiny shapes in the Triton CPU
interpreter (what CI uses to keep this script working).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.gpu_check.base import REAL, TINY, Ctx, Row, _fmt, linear_row, rel_err, status
from tools.gpu_check.e2e import check_e2e
from tools.gpu_check.kernels import (
    _moe_ref,
    _shape_cfg,
    check_attn_decode,
    check_attn_prefill,
    check_attn_prefill_prefix,
    check_ceilings,
    check_moe,
    check_offload,
    check_q4,
)
from tools.gpu_check.step import check_kernel_resources, step_plan

# ---- driver -------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout("check timed out (--check-timeout)")


def _plan(c: Ctx, S) -> list[tuple[str, Any]]:
    state: dict = {}
    plan: list[tuple[str, Any]] = [
        ("ceilings", lambda: check_ceilings(c, S)),
        ("attn prefill", lambda: check_attn_prefill(c, S)),
        ("attn prefill prefix", lambda: check_attn_prefill_prefix(c, S)),
    ]
    for B in S.batches:
        plan.append((f"attn decode B={B}", lambda B=B: check_attn_decode(c, S, B)))
    proj = S.projections[:3] + S.projections[-1:] if c.quick else S.projections
    for name, N, K in proj:
        for M in (1, 8) if c.quick else (1, 4, 8, 32):
            plan.append((f"q4 {name} M={M}", lambda n=name, N=N, K=K, M=M: check_q4(c, S, n, N, K, M)))
    for name, N, K in S.projections[:2] + S.projections[6:8]:
        rows = S.gemm_rows
        plan.append((f"q4 {name} M={rows}", lambda n=name, N=N, K=K, M=rows: check_q4(c, S, n, N, K, M)))
    for T in S.moe_tokens:
        plan.append((f"moe T={T}", lambda T=T: check_moe(c, S, T, state)))
    plan.append(("offload", lambda: check_offload(c, S, state)))
    for B in S.e2e_batches[:1] if c.quick else S.e2e_batches:
        plan.append((f"e2e B={B}", lambda B=B: check_e2e(c, S, B)))
    plan += step_plan(c, S)
    return plan + _quant_plan(c, S) + [("kernel resources", lambda: check_kernel_resources(c, S))]


def _quant_plan(c: Ctx, S) -> list[tuple[str, Any]]:
    """The rows of the other GGUF block types (tools/gpu_check/quant.py), after everything else."""
    from tools.gpu_check import quant as gpu_check_quant

    def shape_cfg(S, layer_types, experts: int, hidden: int, inter: int):
        return _shape_cfg(SimpleNamespace(**{**vars(S), "experts": experts, "hidden": hidden,
                                             "expert_intermediate": inter}), layer_types)

    c.shapes = S
    helpers = SimpleNamespace(Row=Row, rel_err=rel_err, status=status, linear_row=linear_row,
                              moe_ref=_moe_ref, shape_cfg=shape_cfg)
    return gpu_check_quant.plan(c, helpers)


def table(rows: list[Row]) -> str:
    head = ["check", "shape", "status", "max rel err", "triton ms", "torch ms", "speedup", "rate", "peak GiB",
            "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = f"{r.ref_ms / r.ms:.2f}x" if r.ms and r.ref_ms else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    r.check,
                    r.shape,
                    r.status,
                    _fmt(r.err, ".1e"),
                    _fmt(r.ms, ".3f"),
                    _fmt(r.ref_ms, ".3f"),
                    sp,
                    r.rate,
                    _fmt(r.peak, ".2f"),
                    r.note,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--budget-s", type=float, default=480.0, help="total time budget; later checks SKIP")
    p.add_argument("--check-timeout", type=float, default=150.0, help="seconds per check before it FAILs")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU in the Triton interpreter")
    p.add_argument("--dry-run", action="store_true",
                   help="list the checks --quick (or the full run) would run on a GPU, run none")
    args = p.parse_args(argv)
    if args.dry_run:
        import torch

        c = Ctx(torch.device("cpu"), args.quick, args.budget_s, args.check_timeout)
        c.cuda = True  # the CUDA plan
        names = [name for name, _ in _plan(c, TINY if args.cpu_smoke else REAL)]
        print("\n".join(names) + f"\n{len(names)} checks")
        return 0
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing was run. "
            "The kernels are tested on CPU by pytest under TRITON_INTERPRET=1; --cpu-smoke runs this "
            "script's checks at tiny shapes in the interpreter."
        )
        return 0
    dev = torch.device("cuda" if not args.cpu_smoke else "cpu")
    c = Ctx(dev, args.quick or args.cpu_smoke, args.budget_s, args.check_timeout)
    S = TINY if args.cpu_smoke else REAL
    if c.cuda:
        print(f"gpu_check on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    rows: list[Row] = []
    use_alarm = hasattr(signal, "SIGALRM")
    if use_alarm:
        signal.signal(signal.SIGALRM, _on_alarm)
    for name, fn in _plan(c, S):
        if time.monotonic() > c.deadline:
            rows.append(Row(name, "", "SKIP", note="time budget spent"))
            continue
        t0 = time.monotonic()
        if c.cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            if use_alarm:
                signal.alarm(max(1, int(min(c.check_timeout, c.deadline - t0 + 5))))
            new = fn()
        except Exception as e:  # one check's failure must not stop the others
            traceback.print_exc()
            msg = str(e).splitlines()[0][:150] if str(e) else ""
            new = [Row(name, "", "FAIL", note=f"{type(e).__name__}: {msg}")]
        finally:
            if use_alarm:
                signal.alarm(0)
            peak = torch.cuda.max_memory_allocated(dev) / 2**30 if c.cuda else None
            if c.cuda:
                torch.cuda.empty_cache()
        for r in new:
            r.peak = peak
        for r in new:
            print(
                f"{r.status:5s} {r.check:34s} {r.shape:28s} err={_fmt(r.err, '.1e'):8s} "
                f"ms={_fmt(r.ms, '.3f'):9s} torch={_fmt(r.ref_ms, '.3f'):9s} {r.rate} "
                f"[{time.monotonic() - t0:.1f}s]",
                flush=True,
            )
        rows.extend(new)
    out = table(rows)
    print("\n" + out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(out + "\n")
    failed = [r.check for r in rows if r.status == "FAIL"]
    print(f"\n{len(rows)} rows, {len(failed)} FAIL, {sum(r.status == 'SKIP' for r in rows)} SKIP")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
