"""Where one decode step and one prefill chunk spend their time on CPU, per part of the model.

  OMP_NUM_THREADS=1 .venv/bin/python tools/cpu/profile_step.py --gguf 26b-a4b.gguf --cpu-matmul native \
      [--layers 6] [--batch 1] [--prompt-len 128] [--decode-steps 8]
--layers N keeps the first N decoder layers (6 = five sliding + one full = 1/5 of the 26b model, so the
exact path's 1.13 B/weight cache fits in RAM); per-layer parts are scaled by num_layers / N in the
"scaled" column, lm_head / embedding / sampling are not. Timers are the CPU time of the calling thread
(with 1 thread that is the whole cost, robust on a busy machine; use --threads 1).
Parts: attn_proj (q/k/v/o linears), attention (backend), dense_mlp (gate/up/down), router, experts (MoE
backend), embed, lm_head (tied embedding + softcap, sampled rows only), sampling, other (norms, rope,
residuals, metadata, scheduler, Python glue = the step minus the parts).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import torch

TIMES: dict[str, float] = collections.defaultdict(float)
FULL_LAYERS = [0]  # decoder layers of the file before the cut
PER_LAYER = ("attn_proj", "attention", "dense_mlp", "router", "experts", "other")
PARTS = ("attn_proj", "attention", "dense_mlp", "router", "experts", "embed", "lm_head", "sampling")


def timed(part: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        name = part(*a, **k)
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.thread_time() - t0
    return wrapper


def _linear_part(x: torch.Tensor, w: Any, *rest: Any) -> str:
    if "attn_" in w.name:
        return "attn_proj"
    if "token_embd" in w.name:
        return "lm_head_linear"
    return "dense_mlp" if "ffn_" in w.name else "other_linear"


def instrument(layers: int) -> None:
    import swaserve.engine.runner.model_runner as runner
    import swaserve.models.architectures as registry
    import swaserve.models.gemma4 as gemma
    import swaserve.models.gemma4_ops as layer_ops

    arch = registry.ARCHITECTURES["gemma4"]

    def load_cut(file: Any, progress: bool) -> Any:
        loaded = arch.load(file, progress)
        FULL_LAYERS[0] = loaded.config.num_layers
        if layers < loaded.config.num_layers:
            kinds = loaded.config.layer_types[:layers]
            cfg = dataclasses.replace(loaded.config, num_layers=layers, layer_types=kinds)
            loaded.weights.layers = loaded.weights.layers[:layers]
            loaded = dataclasses.replace(loaded, config=cfg)
        return loaded

    registry.ARCHITECTURES["gemma4"] = dataclasses.replace(arch, load=load_cut)
    # every linear of the model goes through Gemma4Model._linear (the native path calls the kernel there)
    gemma.Gemma4Model._linear = timed(lambda self, x, w: _linear_part(x, w), gemma.Gemma4Model._linear)
    gemma.embedding = timed(lambda *a, **k: "embed", gemma.embedding)
    for ops in (layer_ops.TorchOps, layer_ops.NativeOps):  # the router is a layer step of each backend
        ops.route = timed(lambda *a, **k: "router", ops.route)
    gemma.Gemma4Model.logits = timed(lambda *a, **k: "lm_head", gemma.Gemma4Model.logits)
    runner.sample_isolated = timed(lambda *a, **k: "sampling", runner.sample_isolated)


def table(title: str, total: float, parts: dict[str, float], scale: float) -> str:
    rows = [(p, parts.get(p, 0.0)) for p in PARTS]
    rows.append(("other", total - sum(v for _, v in rows)))
    scaled = [(p, v * (scale if p in PER_LAYER else 1.0)) for p, v in rows]
    full = sum(v for _, v in scaled)
    out = [f"\n### {title}: {total * 1e3:.0f} ms measured, {full * 1e3:.0f} ms scaled to the full model",
           "| part | ms | ms scaled | % |", "|---|---|---|---|"]
    for (part, v), (_, sv) in zip(rows, scaled):
        out.append(f"| {part} | {v * 1e3:.1f} | {sv * 1e3:.1f} | {100 * sv / full:.1f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--cpu-matmul", default="native", choices=["native", "exact", "fast"])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--kv-dtype", default="auto", help="KV pool dtype: auto (q8_0 on CPU), fp32, bf16, q8_0")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    instrument(args.layers)
    from swaserve.engine.core import SamplingParams
    from swaserve.llm import LLM

    b = args.batch
    llm = LLM(args.gguf, progress=True, cpu_matmul=args.cpu_matmul, cpu_threads=args.threads, device="cpu",
              max_running_requests=max(8, b), chunked_prefill_size=max(512, b * args.prompt_len),
              kv_cache_dtype=args.kv_dtype)
    eng = llm.engine
    model = eng.runner.model
    model.attn.forward = timed(lambda *a, **k: "attention", model.attn.forward)
    if hasattr(model, "_decode"):  # the flat decode loop (models/gemma4_decode.py; older trees lack it)
        model._decode.attend = timed(lambda *a, **k: "attention", model._decode.attend)
    model.moe.forward = timed(lambda *a, **k: "experts", model.moe.forward)
    rng = random.Random(0)
    count = [0]

    def add(gen: int) -> None:
        for _ in range(b):
            count[0] += 1
            ids = [2] + [rng.randint(300, 2999) for _ in range(args.prompt_len - 1)]
            params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
            eng.add_request(f"p{count[0]}", ids, params)

    def step() -> tuple[float, dict[str, float]]:
        TIMES.clear()
        t0 = time.thread_time()
        eng.step()
        return time.thread_time() - t0, dict(TIMES)

    for _ in range(2):  # warm-up: lazy caches of the exact / fast paths, experts touched
        add(4)
        while eng.has_unfinished():
            eng.step()
    add(args.decode_steps + 1)
    prefill = step()
    decodes = [step() for _ in range(args.decode_steps)]
    while eng.has_unfinished():
        eng.step()
    scale = FULL_LAYERS[0] / eng.model_config.num_layers
    mid = sorted(decodes, key=lambda d: d[0])[len(decodes) // 2]
    print(f"{args.gguf}: cpu_matmul {args.cpu_matmul}, kv {args.kv_dtype}, {args.layers} layers, batch {b}, "
          f"{args.threads} thread(s), {args.prompt_len}-token prompts")
    print(table(f"prefill chunk ({b} x {args.prompt_len} tokens)", *prefill, scale))
    print(table(f"decode step (batch {b}, median of {len(decodes)})", *mid, scale))


if __name__ == "__main__":
    main()
