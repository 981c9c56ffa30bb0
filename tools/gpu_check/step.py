"""tools/gpu_check/run.py's step-level checks (issue 17 item 8): what a decode step costs on the device.

- decode ms per step at batch 1 and 32 on the fused model: wall time, GPU-busy time (the sum of the
  kernels' durations in the torch profiler), kernel launches per step, and the step replayed as one
  CUDA graph;
- the largest planned step (a --chunked-prefill-size chunk + --max-running-requests decodes + logits
  + top-p, engine/runner/peak_step.py) and its peak memory;
- the offload backend's host buffer: pinned (registered) bytes vs logical bytes, host -> device GB/s;
- lm_head logits with an F16 embedding (fp32 out, the hidden rows cast, never the [V, H] weight)
  against the old per-call conversion of the weight;
- registers / spills / shared memory of every Triton kernel the run compiled (from the JIT caches).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from tools.gpu_check.base import Ctx, Row, rel_err
from tools.gpu_check.e2e import _e2e_config, _random_weights
from tools.gpu_check.kernels import _moe_cfg, _moe_layers, rand_q4

_MODELS: dict[tuple, Any] = {}  # one random model per shape set (built once: ~14 GB at 26b-a4b)


def _model(c: Ctx, S):
    key = (S.preset, str(c.dev))
    if key not in _MODELS:
        from swaserve.engine.attention.triton_backend import TritonAttentionBackend
        from swaserve.engine.moe.triton_backend import TritonMoE
        from swaserve.models.gemma4 import Gemma4Model

        cfg = _e2e_config(S)
        weights = _random_weights(c, cfg)
        _MODELS.clear()
        moe = TritonMoE(cfg, weights.experts, c.dev)
        _MODELS[key] = Gemma4Model(cfg, weights, TritonAttentionBackend(), moe, c.dev, dtype=c.torch.bfloat16)
    return _MODELS[key]


def _decode_inputs(c: Ctx, model, B: int, ctx: int):
    """A KV pool and the metadata of one decode step of B sequences at context `ctx` (keys unwritten:
    the timing does not depend on their values)."""
    torch = c.torch
    from swaserve.engine.attention.base import AttentionMetadata
    from swaserve.engine.attention.kv_pool import KVPool

    cfg, P = model.cfg, 16
    per = -(-(ctx + 1) // P)
    pool = KVPool(cfg, B * per, B * per, P, torch.bfloat16, c.dev)
    pt = torch.arange(B * per).view(B, per)
    pos = torch.full((B,), ctx, dtype=torch.int64)
    slots = pt[torch.arange(B), pos // P] * P + pos % P
    meta = AttentionMetadata(P, cfg.sliding_window, [1] * B, [ctx] * B, pos, slots, slots, pt, pt).to(c.dev)
    return pool, meta


def check_decode_step(c: Ctx, S, B: int) -> list[Row]:
    torch = c.torch
    model = _model(c, S)
    ctx = S.e2e_prompt
    pool, meta = _decode_inputs(c, model, B, ctx)
    ids = torch.zeros(B, dtype=torch.int64, device=c.dev)

    def step():
        return model.logits(model.forward(ids, meta, pool))

    sync = torch.cuda.synchronize if c.cuda else (lambda: None)
    if c.cuda:
        step()  # compile
        sync()
    n = (3 if c.quick else 10) if c.cuda else 1  # CPU smoke: the interpreter is slow
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    wall = (time.perf_counter() - t0) / n * 1e3
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if c.cuda else [])
    reps = 2 if c.cuda else 1
    with profile(activities=acts) as prof:
        for _ in range(reps):
            step()
        sync()
    if c.cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e3 / reps  # ms per step
        launches = len(kernels) / reps
        note = f"GPU-busy {busy:.3f} ms, {launches:.0f} kernels/step"
    else:
        note = f"{len(prof.events()) / reps:.0f} profiler events/step (CPU: no GPU-busy time)"
    graph_ms = None
    if c.cuda:  # the same step replayed as one CUDA graph (engine/runner/cuda_graphs.py does this per bucket)
        attn = model.attn
        attn.length_free_splits = True
        try:
            step()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
        finally:
            attn.length_free_splits = False
        graph_ms = c.time_ms(g.replay)
        note += f"; graph replay {graph_ms:.3f} ms"
    return [Row(f"decode step B={B}", f"{S.preset} ctx {ctx}", "ok", None, wall, graph_ms,
                f"{B / wall * 1e3:.0f} tok/s", f"ms = wall per step; torch ms = graph replay; {note}")]


def check_peak_step(c: Ctx, S) -> list[Row]:
    """engine/runner/peak_step.py's largest planned step on the fused model, and its peak memory."""
    torch = c.torch
    from swaserve.engine.config import EngineConfig, SchedulerConfig
    from swaserve.engine.runner.peak_step import run_peak_step

    model = _model(c, S)
    chunk, decodes = (2048, 64) if c.cuda else (24, 3)
    cfg = EngineConfig(scheduler=SchedulerConfig(chunked_prefill_size=chunk, max_running_requests=decodes))
    base = torch.cuda.memory_allocated(c.dev) if c.cuda else 0
    if c.cuda:
        torch.cuda.reset_peak_memory_stats(c.dev)
    t0 = time.perf_counter()
    bundle = SimpleNamespace(model=model, config=model.cfg, device=c.dev, vision=None, vision_spec=None)
    logits, pool_bytes = run_peak_step(bundle, cfg)
    ok = bool(torch.isfinite(logits).all())
    ms = (time.perf_counter() - t0) * 1e3
    note = f"chunk {chunk} + {decodes} decodes + logits + top-p"
    if c.cuda:
        peak = torch.cuda.max_memory_allocated(c.dev) - base - pool_bytes
        free, total = torch.cuda.mem_get_info(c.dev)
        note += (f"; transient peak {peak / 2**30:.2f} GiB (pool {pool_bytes / 2**20:.0f} MiB), "
                 f"free {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    return [Row("max-size step", S.preset, "ok" if ok else "FAIL", None, ms, None, "", note)]


def check_offload_memory(c: Ctx, S) -> list[Row]:
    """Pinned vs logical bytes of the offload host buffer and host -> device bandwidth from it."""
    torch = c.torch
    from swaserve.engine.moe.offload_backend import OffloadMoE

    layers = 4 if c.cuda else 2
    experts = _moe_layers(c, S, layers)
    off = OffloadMoE(_moe_cfg(S, layers), experts, c.dev, cache_size=1, emulate_device=not c.cuda)
    note = (f"host {off.host_bytes / 2**30:.2f} GiB for {off.logical_bytes / 2**30:.2f} GiB logical "
            f"({off.host_bytes / max(off.logical_bytes, 1):.3f}x), mapped {off.mapped}")
    ms, rate = None, ""
    if c.cuda:
        src = off.gate_up[0].data  # one layer's stack in the registered buffer
        dst = torch.empty_like(src, device=c.dev)
        ms = c.time_ms(lambda: dst.copy_(src, non_blocking=True))
        rate = f"H2D {src.nbytes / (ms * 1e-3) / 1e9:.1f} GB/s ({src.nbytes / 2**20:.0f} MiB)"
    return [Row("offload host buffer", f"{layers} layers", "ok", None, ms, None, rate, note)]


def check_logits_f16(c: Ctx, S) -> list[Row]:
    torch = c.torch
    import torch.nn.functional as F

    from swaserve.engine.fused.weights import logits_fp32
    from swaserve.engine.quant.base import QWeight

    V, H = (262144, S.hidden) if c.cuda else (512, S.hidden)
    w = QWeight("F16", (V, H), torch.randn(V, H, device=c.dev, generator=c.gen).half() * 0.02, "embed")
    rows = []
    for B in (1, 32) if c.cuda else (2,):
        x = torch.randn(B, H, device=c.dev, generator=c.gen).to(torch.bfloat16)
        y = logits_fp32(x, w)
        ref = x.double() @ w.data.double().t()
        ms = c.time_ms(lambda x=x: logits_fp32(x, w))
        old = c.time_ms(lambda x=x: F.linear(x, w.data.to(x.dtype)))  # the per-call weight conversion
        err = rel_err(y, ref)
        good = err < 2e-2 and y.dtype == torch.float32
        rows.append(Row(f"logits F16 embed B={B}", f"V{V} H{H}", "ok" if good else "FAIL", err, ms, old, "",
                        "torch ms = the old per-call weight conversion"))
    return rows


def check_kernel_resources(c: Ctx, S) -> list[Row]:
    """Registers, spills and shared memory of every kernel the checks above compiled and launched."""
    import importlib

    import triton

    mods = ["swaserve.engine.attention.triton_kernels", "swaserve.engine.quant.triton_q4",
            "swaserve.engine.moe.triton_backend", "swaserve.engine.fused.norm_kernels",
            "swaserve.engine.fused.moe_kernels"]
    rows = []
    for m in mods:
        mod = importlib.import_module(m)
        for name, fn in vars(mod).items():
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            for caches in getattr(fn, "device_caches", {}).values():
                for key, k in caches[0].items():
                    init = getattr(k, "_init_handles", None)
                    if init is not None:
                        init()
                    regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
                    md = k.metadata
                    shape = f"warps {md.num_warps} stages {md.num_stages}"
                    note = f"regs {regs}, spills {spills}, shared {md.shared} B; {str(key)[:160]}"
                    rows.append(Row(f"kernel {name}", shape, "ok" if not spills else "FAIL", note=note))
    if not rows:
        rows.append(Row("kernel resources", "", "info", note="no compiled kernels (Triton interpreter)"))
    return rows


def step_plan(c: Ctx, S) -> list[tuple[str, Any]]:
    plan: list[tuple[str, Any]] = [(f"decode step B={B}", lambda B=B: check_decode_step(c, S, B))
                                   for B in ((1, 32) if c.cuda else (1, 3))]
    plan += [("max-size step", lambda: check_peak_step(c, S)),
             ("offload host buffer", lambda: check_offload_memory(c, S)),
             ("logits F16", lambda: check_logits_f16(c, S))]
    return plan


__all__ = ["check_kernel_resources", "rand_q4", "step_plan"]
