"""Where a batch-1 decode step's wall time goes inside the native step (engine/quant/native_step.c), and
around it, at a given thread count.

  python tools/cpu/profile_native_step.py --gguf small.gguf --threads 1,2 [--steps 64] [--flat]

Builds the kernels once more with -DSTEP_TIMERS (wall-clock marks between the step's parts, summed over
the layers) and runs greedy decode steps of one 128-token request through the engine. Prints ms per step
per part, the native call in total, the rest of the model's forward (embedding, rope rows, attention
plans, final norm), the lm_head, and the rest of the engine step (scheduler, sampling, detokenizing).
--flat runs the Python flat loop instead (models/gemma4_decode.py) for the same outer columns.
"""

from __future__ import annotations

import argparse
import ctypes
import time

PARTS = ("norms", "qkv", "rope+store", "attention", "o_proj", "gate_up", "down", "router", "experts", "tail")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help="model file (default: the built-in demo model)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kv-dtype", default="fp16")
    ap.add_argument("--flat", action="store_true", help="the Python flat loop instead of the native step")
    args = ap.parse_args()

    from swaserve.engine.core import SamplingParams
    from swaserve.engine.quant import native, native_step
    from swaserve.llm import LLM

    timed = native.build_variant(("-DSTEP_TIMERS",))
    timed.swa_step_times.argtypes, timed.swa_step_times.restype = [ctypes.c_void_p], None
    native.load()
    native._lib = timed  # every native call of this process goes to the timed build
    run = native_step.run
    print(f"{'threads':>7} | " + " | ".join(f"{p:>10}" for p in PARTS) + " | native | forward rest | lm_head "
          "| step rest | step ms | tok/s")
    for threads in (int(t) for t in args.threads.split(",")):
        llm = LLM(args.gguf, cpu_matmul="native", device="cpu", cpu_threads=threads,
                  kv_cache_dtype=args.kv_dtype, kv_cache_memory_gb=2, max_running_requests=8)
        model = llm.engine.runner.model
        model._decode.native.enabled = not args.flat
        acc = {"native": 0.0, "forward": 0.0, "lm_head": 0.0}

        def clocked(name: str, fn, acc=acc):  # type: ignore[no-untyped-def]
            def inner(*a, **kw):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    acc[name] += time.perf_counter() - t0
            return inner

        native_step.run = clocked("native", native_step.run)
        model.forward, model.logits = clocked("forward", model.forward), clocked("lm_head", model.logits)
        parts = (ctypes.c_double * len(PARTS))()
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
        llm.engine.add_request("profile", [2] + [300 + i % 900 for i in range(127)], params)
        llm.engine.step()  # the prefill
        llm.engine.step()
        timed.swa_step_times(parts)
        for k in acc:
            acc[k] = 0.0
        t0, steps = time.perf_counter(), 0
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps += 1
        wall = time.perf_counter() - t0
        timed.swa_step_times(parts)
        ms = [v / steps * 1e3 for v in parts]
        rest_fwd = (acc["forward"] - acc["native"]) / steps * 1e3
        rest_step = (wall - acc["forward"] - acc["lm_head"]) / steps * 1e3
        print(f"{threads:>7} | " + " | ".join(f"{v:>10.3f}" for v in ms)
              + f" | {acc['native'] / steps * 1e3:.3f} | {rest_fwd:.3f} | {acc['lm_head'] / steps * 1e3:.3f}"
              f" | {rest_step:.3f} | {wall / steps * 1e3:.2f} | {steps / wall:.1f}")
        llm.close()
        native_step.run = run


if __name__ == "__main__":
    main()
