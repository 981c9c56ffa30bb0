"""Device ops per decode layer at the 26b-a4b layer shapes, reference path vs the fused path.

    python -m tools.cpu.op_count [--batch 1 32]

Runs on the CPU, no GPU needed: a two-layer model (one sliding, one full layer) with the 26b-a4b
shapes and zero Q4_0 weights runs a decode step the way CUDA would (the Triton linears, attention
and MoE backends). Every aten op that launches a kernel (views, allocations and metadata ops
excluded) is counted with a TorchDispatchMode, and every Triton launch is counted and skipped (so
the numbers are about launches, not values; nothing reads a value back, see test_no_host_sync).
The SM count is pinned to an H200's (132), which sets the split-K choices of the linears.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NO_KERNEL = {  # ops that only make views, allocate or read metadata: no device launch
    "view", "_unsafe_view", "reshape", "slice", "select", "transpose", "t", "as_strided", "unsqueeze",
    "squeeze", "expand", "alias", "detach", "empty", "empty_strided", "empty_like", "permute",
    "lift_fresh", "split", "unbind", "_reshape_alias", "view_as", "new_empty", "new_empty_strided",
    "split_with_sizes", "is_nonzero", "sym_size", "sym_stride", "dim", "size", "stride",
}
SMS = 132  # H200


class Counts:
    def __init__(self) -> None:
        self.label = "outside"
        self.ops: dict[str, Counter[str]] = {}

    def add(self, name: str) -> None:
        self.ops.setdefault(self.label, Counter())[name] += 1


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.counts.add("aten." + name)
        return func(*args, **(kwargs or {}))


def build(batch: int) -> tuple[Any, Any, Any, Any]:
    """(model, meta, pool, ids) of a decode step of `batch` sequences at the 26b-a4b layer shapes."""
    from swaserve.engine.attention.kv_pool import KVPool
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend
    from swaserve.engine.core import Batch, Req, SamplingParams
    from swaserve.engine.moe.base import ExpertWeights
    from swaserve.engine.moe.triton_backend import TritonMoE
    from swaserve.engine.quant.base import QWeight
    from swaserve.engine.runner.model_runner import build_metadata
    from swaserve.models.demo.tiny import preset_config
    from swaserve.models.gemma4 import Gemma4Model
    from swaserve.models.weights import Gemma4Weights, LayerWeights

    cfg = dataclasses.replace(preset_config("26b-a4b"), num_layers=2, layer_types=("sliding", "full"),
                              vocab_size=1024)

    def q4(*shape: int) -> QWeight:  # zero Q4_0 blocks: 18 bytes per 32 weights
        return QWeight("Q4_0", shape, torch.zeros(*shape[:-1], shape[-1] // 32 * 18, dtype=torch.uint8))

    H, E = cfg.hidden_size, cfg.num_experts
    ones = torch.ones
    layers = []
    for kind in cfg.layer_types:
        D = cfg.head_dim_swa if kind == "sliding" else cfg.head_dim_full
        kvh = cfg.num_kv_heads_swa if kind == "sliding" else cfg.num_kv_heads_full
        layers.append(LayerWeights(
            attn_norm=ones(H), q_proj=q4(cfg.num_heads * D, H), k_proj=q4(kvh * D, H),
            v_proj=q4(kvh * D, H) if kind == "sliding" else None, o_proj=q4(H, cfg.num_heads * D),
            q_norm=ones(D), k_norm=ones(D), post_attention_norm=ones(H), ffn_norm=ones(H),
            gate_proj=q4(cfg.intermediate_size, H), up_proj=q4(cfg.intermediate_size, H),
            down_proj=q4(H, cfg.intermediate_size), post_ffw_norm_1=ones(H), router=torch.zeros(E, H),
            router_scale=ones(H), pre_ffw_norm_2=ones(H),
            experts=ExpertWeights(q4(E, 2 * cfg.moe_intermediate_size, H),
                                  q4(E, H, cfg.moe_intermediate_size)),
            per_expert_scale=ones(E), post_ffw_norm_2=ones(H), post_ffw_norm=ones(H), layer_scalar=ones(1)))
    weights = Gemma4Weights(q4(cfg.vocab_size, H), ones(H), layers)
    cpu = torch.device("cpu")
    model = Gemma4Model(cfg, weights, TritonAttentionBackend(), TritonMoE(cfg, weights.experts, cpu), cpu,
                        dtype=torch.bfloat16)
    prefix, page = 256, 16
    per_seq = prefix // page + 1
    reqs = [Req(f"r{b}", "r", b, [0] * (prefix + 1), prefix, SamplingParams(),
                full_pages=list(range(b * per_seq, (b + 1) * per_seq)),
                swa_pages=list(range(b * per_seq, (b + 1) * per_seq))) for b in range(batch)]
    step = Batch(reqs, [1] * batch, [prefix] * batch, [True] * batch)
    pool = KVPool(cfg, batch * per_seq, batch * per_seq, page, torch.bfloat16, cpu)
    meta = build_metadata(step, page, cfg.sliding_window)
    return model, meta, pool, torch.zeros(batch, dtype=torch.int64)


def count(batch: int, fused: bool) -> Counts:
    """Op counts of one decode step, by label (layer kind, or 'outside' the layers)."""
    import triton.runtime.interpreter as interp

    from swaserve.engine.quant import triton_q4
    from swaserve.models import gemma4

    model, meta, pool, ids = build(batch)
    counts = Counts()
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def launch(self, *args, **kwargs):  # a Triton launch: counted, not run
        counts.add("triton." + getattr(self.fn, "__name__", "kernel"))

    def labelled(fn: Callable, kind_of: Callable[..., str]) -> Callable:
        def run(*args, **kwargs):
            before, counts.label = counts.label, kind_of(*args)
            try:
                return fn(*args, **kwargs)
            finally:
                counts.label = before
        return run

    kind = ["sliding", "full"]
    patch(interp.InterpretedFunction, "run", launch)
    patch(triton_q4, "_num_sms", lambda device: SMS)
    patch(model.attn, "_sms", lambda device: SMS)
    patch(gemma4, "linear", lambda x, w, cpu_matmul="exact": triton_q4.quant_linear(x, w))  # CUDA's choice
    patch(model, "_layer", labelled(model._layer, lambda i, *a: kind[i]))  # the layer body of both paths
    try:
        if fused:
            from swaserve.engine.fused.ops import device_kernels

            with _Mode(counts), device_kernels():
                model.forward(ids, meta, pool)
        else:
            with _Mode(counts):
                model.forward(ids, meta, pool)
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--detail", action="store_true", help="list the ops of each layer kind")
    ap.add_argument("--paths", nargs="+", choices=("reference", "fused"), default=["reference", "fused"])
    args = ap.parse_args(argv)
    print("| batch | path | sliding layer | full layer | outside the layers | step (25 sliding + 5 full) |")
    print("|---|---|---|---|---|---|")
    for b in args.batch:
        for fused in [f == "fused" for f in args.paths]:
            c = count(b, fused)
            n = {k: sum(v.values()) for k, v in c.ops.items()}
            step = 25 * n.get("sliding", 0) + 5 * n.get("full", 0) + n.get("outside", 0)
            path = "fused" if fused else "reference"
            sliding, full, outside = n.get("sliding", 0), n.get("full", 0), n.get("outside", 0)
            print(f"| {b} | {path} | {sliding} | {full} | {outside} | {step} |")
            if args.detail:
                for label, ops in c.ops.items():
                    print(f"    {label}: " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
