"""Engine flags shared by `swaserve serve`, `generate` and `bench`; validated before any model loads."""

from __future__ import annotations

import argparse
import os

from swaserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig


def _positive_int(name: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {v}")
        return v

    return parse


def _nonneg_int(name: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v

    return parse


def _ratio(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--swa-full-tokens-ratio must be a number, got {s!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"--swa-full-tokens-ratio must be in (0, 1], got {v}")
    return v


def _positive_float(name: str):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be positive, got {v}")
        return v

    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help="path to a Gemma 4 GGUF (default: the built-in demo model)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto")
    g.add_argument("--moe-backend", choices=["auto", "torch", "triton", "offload"], default="auto")
    g.add_argument("--moe-cache-size", type=_nonneg_int("--moe-cache-size"), default=0,
                   help="experts kept on the GPU by the offload backend (0 = size from free memory)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without a seed")
    g.add_argument("--cpu-threads", type=_positive_int("--cpu-threads"), default=None,
                   help="torch threads for CPU compute (default: all cores; `serve` leaves one core "
                        "to the HTTP server)")
    c = p.add_argument_group("KV cache")
    c.add_argument("--cache-type", choices=["radix", "naive"], default="radix",
                   help="radix: SWA-aware prefix cache; naive: no cross-request reuse")
    c.add_argument("--page-size", type=_positive_int("--page-size"), default=16)
    c.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    c.add_argument("--kv-cache-memory-gb", type=_positive_float("--kv-cache-memory-gb"), default=None,
                   help="memory for both KV pools (default: a fraction of free device memory)")
    c.add_argument("--max-total-tokens", type=_positive_int("--max-total-tokens"), default=None,
                   help="full-attention pool size in tokens (overrides --kv-cache-memory-gb)")
    c.add_argument("--swa-full-tokens-ratio", type=_ratio, default=0.25,
                   help="SWA pool tokens / full pool tokens (default 0.25)")
    c.add_argument("--swa-retain-budget", type=_nonneg_int("--swa-retain-budget"), default=512,
                   help="tokens of divergence before an anchor whose SWA window is kept (default 512)")
    c.add_argument("--swa-retain-policy", choices=["lazy", "eager"], default="lazy",
                   help="lazy: evict SWA only under pressure; eager: trim at finish like the seed engine")
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-running-requests", type=_positive_int("--max-running-requests"), default=64)
    s.add_argument("--chunked-prefill-size", type=_positive_int("--chunked-prefill-size"), default=2048)
    s.add_argument("--max-queued-requests", type=_positive_int("--max-queued-requests"), default=1024)
    s.add_argument("--context-length", type=_positive_int("--context-length"), default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen config; raises ValueError with a one-line message on bad input."""
    if args.model is not None and not os.path.isfile(args.model):
        raise ValueError(f"--model {args.model}: no such file")
    full_tokens = args.max_total_tokens
    swa_tokens = None
    if full_tokens is not None:
        swa_tokens = max(args.page_size, int(full_tokens * args.swa_full_tokens_ratio))
    cache = CacheConfig(
        page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype,
        full_tokens=full_tokens,
        swa_tokens=swa_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        cache_type=args.cache_type,
        swa_retain_budget=args.swa_retain_budget,
        swa_retain_policy=args.swa_retain_policy,
    )
    sched = SchedulerConfig(
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_queued_requests=args.max_queued_requests,
        context_length=args.context_length,
    )
    if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {args.device!r}")
    return EngineConfig(
        model_path=args.model,
        cache=cache,
        scheduler=sched,
        attention_backend=args.attention_backend,
        moe_backend=args.moe_backend,
        moe_cache_size=args.moe_cache_size,
        device=args.device,
        cpu_threads=args.cpu_threads,
        seed=args.seed,
    )
