"""CPU speed of the linear paths for every GGUF block type at the real gemma-4-26B-A4B shapes.

`python -m tools.cpu.quant_types [--rows 1] [--threads 1] [--types Q4_0,Q4_K,...] [--modes exact,native]`
prints, per `--cpu-matmul` mode and type,
the best time per call of engine.quant.linear (fp32 input) on a random weight of that
type (models/demo/random_blocks.py) at each projection / expert shape of tools/cpu/quant_matmul.py, their
sum (one pass over every shape), and that sum as a multiple of Q4_0's, measured side by side in one
run. exact: Q4_0 and Q8_0 use the cached int8-codes form; the other types decode their stored blocks on
each call (engine/quant/formats.py). native: the integer kernels (native.py for Q4_0, native_k.py for the
types it has; the rest fall back to exact). With several modes, a last table gives each type's summed
time per mode as a multiple of the first mode's. Shapes whose K is not whole blocks of a type are skipped (-).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.linear import linear
from swaserve.models.demo.quant_mix import BLOCK_QTYPES, block_elems
from swaserve.models.demo.random_blocks import random_blocks
from tools.cpu.quant_matmul import LM_HEAD, SHAPES, time_call


def run(types: list[str], rows: int, out=sys.stdout, mode: str = "exact",
        lm_head: bool = False) -> dict[str, float]:
    """Print the table; return {type: summed ms over the shapes every type can hold} (`lm_head`: the
    262144 x 2816 tied lm_head shape alone)."""
    shapes = [LM_HEAD] if lm_head else SHAPES
    dev = torch.device("cpu")
    print(f"threads {torch.get_num_threads()}, rows {rows}, fp32 input, --cpu-matmul {mode}", file=out)
    cols = [f"{name} ({k}->{n})" for name, k, n in shapes]
    print("| type | " + " | ".join(cols) + " | sum ms | x Q4_0 |", file=out)
    print("|" + "---|" * (len(cols) + 3), file=out)
    common = [s for s in shapes if all(s[1] % block_elems(t) == 0 for t in types)]
    sums: dict[str, float] = {}
    for qtype in types:
        cells, total = [], 0.0
        for name, k, n in shapes:
            if k % block_elems(qtype):
                cells.append("-")
                continue
            raw = random_blocks(qtype, (n, k), k ** -0.5, np.random.default_rng(0))
            w = QWeight(qtype, (n, k), torch.from_numpy(raw), name)
            x = torch.randn(rows, k)
            ms = time_call(lambda: linear(x, w, mode), dev) * 1e3  # noqa: B023
            cells.append(f"{ms:.2f}")
            total += ms if (name, k, n) in common else 0.0
        sums[qtype] = total
        ratio = f"{total / sums['Q4_0']:.1f}" if "Q4_0" in sums else ""
        print(f"| {qtype} | " + " | ".join(cells) + f" | {total:.1f} | {ratio} |", file=out, flush=True)
    if len(common) < len(shapes):
        print(f"sum over the shapes every listed type holds: {', '.join(s[0] for s in common)}", file=out)
    return sums


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cpu.quant_types", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1, help="input rows (default 1: decode)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--lm-head", action="store_true",
                   help="time only the 262144 x 2816 tied lm_head shape (its weight: 0.5-1 GB per type)")
    p.add_argument("--modes", default="exact", help="--cpu-matmul modes, comma-separated (default exact)")
    p.add_argument("--types", default=",".join(BLOCK_QTYPES), help="comma-separated types (Q4_0 first)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    types = [t for t in args.types.split(",") if t]
    bad = [t for t in types if t not in BLOCK_QTYPES]
    if bad:
        raise SystemExit(f"--types: unknown {bad}; expected some of {', '.join(BLOCK_QTYPES)}")
    modes = [m for m in args.modes.split(",") if m]
    sums = {m: run(types, args.rows, mode=m, lm_head=args.lm_head) for m in modes}
    if len(modes) > 1:
        print("| type | " + " | ".join(f"{m} / {modes[0]}" for m in modes[1:]) + " |")
        print("|" + "---|" * len(modes))
        for t in types:
            base = sums[modes[0]][t]
            cells = [f"{sums[m][t] / base:.3f}" if base else "-" for m in modes[1:]]
            print(f"| {t} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
