"""engine/args.py: flags built from the config fields, one bounded-number validator, both config builders;
engine/registry.py: backend and prefix-cache names and auto rules; --cpu-matmul reaching the linears."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from swaserve.engine.args import (
    add_engine_args,
    bounded_number,
    engine_config_from_args,
    engine_config_from_kwargs,
)
from swaserve.engine.attention import ATTENTION_BACKENDS, get_attention_backend
from swaserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from swaserve.engine.kvcache import PREFIX_CACHES, NaiveCache, PageAllocator, SWARadixCache
from swaserve.engine.moe import MOE_BACKENDS


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_flag_defaults_are_the_config_defaults(monkeypatch) -> None:
    monkeypatch.delenv("SWASERVE_DEBUG", raising=False)
    assert engine_config_from_args(_parse()) == EngineConfig() == engine_config_from_kwargs()
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("flag") or f.name in ("swa_tokens", "cache", "scheduler"), f.name


@pytest.mark.parametrize("flag, kind, bounds, text, message", [
    ("--page-size", int, dict(min=1), "0", "--page-size must be at least 1, got 0"),
    ("--page-size", int, dict(min=1), "x", "--page-size must be an integer, got 'x'"),
    ("--moe-cache-size", int, dict(min=0), "-1", "--moe-cache-size must be >= 0, got -1"),
    ("--kv-cache-memory-gb", float, dict(min=0, min_exclusive=True), "0", "--kv-cache-memory-gb must be "
     "positive, got 0.0"),
    ("--kv-cache-memory-gb", float, dict(min=0, min_exclusive=True), "a", "--kv-cache-memory-gb must be a "
     "number, got 'a'"),
    ("--swa-full-tokens-ratio", float, dict(min=0, max=1, min_exclusive=True), "1.5",
     "--swa-full-tokens-ratio must be in (0, 1], got 1.5"),
])
def test_bounded_number_messages(flag, kind, bounds, text, message) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        bounded_number(flag, kind, **bounds)(text)
    assert str(e.value) == message


def test_bounded_number_accepts_the_bounds() -> None:
    ratio = bounded_number("--r", float, min=0, max=1, min_exclusive=True)
    assert ratio("1") == 1.0 and ratio("0.25") == 0.25
    assert bounded_number("--n", int, min=0)("0") == 0


def test_numeric_and_new_flags(monkeypatch) -> None:
    monkeypatch.delenv("SWASERVE_DEBUG", raising=False)
    cfg = engine_config_from_args(_parse("--max-total-tokens", "1000", "--swa-full-tokens-ratio", "0.5",
                                         "--page-size", "4", "--cpu-matmul", "fast", "--debug-checks"))
    assert cfg.cache.full_tokens == 1000 and cfg.cache.swa_tokens == 500 and cfg.cache.page_size == 4
    assert cfg.cpu_matmul == "fast" and cfg.debug_checks
    assert engine_config_from_args(_parse()).cpu_matmul == "native"
    monkeypatch.setenv("SWASERVE_DEBUG", "1")
    assert engine_config_from_args(_parse()).debug_checks and EngineConfig().debug_checks
    monkeypatch.setenv("SWASERVE_DEBUG", "0")
    assert not engine_config_from_args(_parse()).debug_checks


def test_config_from_kwargs() -> None:
    cfg = engine_config_from_kwargs(None, page_size=4, max_running_requests=3, cache_type="naive",
                                    device="cpu", max_total_tokens=1000, cpu_matmul="fast")
    assert cfg.cache.page_size == 4 and cfg.cache.cache_type == "naive" and cfg.cache.full_tokens == 1000
    assert cfg.cache.swa_tokens is None  # sized by the engine from the ratio
    assert cfg.scheduler.max_running_requests == 3 and cfg.device == "cpu" and cfg.cpu_matmul == "fast"
    with pytest.raises(ValueError, match="unknown engine argument"):
        engine_config_from_kwargs(None, page_sise=4)


def test_backend_registries() -> None:
    assert ATTENTION_BACKENDS.choices == ("auto", "torch", "native", "triton")
    assert MOE_BACKENDS.choices == ("auto", "torch", "cpu", "triton", "offload")
    assert ATTENTION_BACKENDS.resolve("auto", torch.device("cpu")) == "torch"
    assert ATTENTION_BACKENDS.resolve("auto", torch.device("cuda")) == "triton"
    assert MOE_BACKENDS.resolve("auto", [], torch.device("cpu")) == "torch"
    assert type(get_attention_backend("auto", torch.device("cpu"))).__name__ == "TorchAttentionBackend"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope", torch.device("cpu"))


def test_cache_type_registry() -> None:
    assert PREFIX_CACHES.choices == ("radix", "naive")  # no "auto"
    assert engine_config_from_args(_parse("--cache-type", "naive")).cache.cache_type == "naive"
    with pytest.raises(SystemExit):
        _parse("--cache-type", "auto")
    cfg = CacheConfig(page_size=4, swa_retain_budget=64, swa_retain_policy="eager")
    full, swa = PageAllocator(8), PageAllocator(8)
    radix = PREFIX_CACHES.load("radix").create(cfg, 32, full, swa)
    assert isinstance(radix, SWARadixCache) and (radix.window, radix.swa_retain_tokens) == (32, 64)
    assert radix.retain_policy == "eager"
    assert isinstance(PREFIX_CACHES.load("naive").create(cfg, 32, full, swa), NaiveCache)
    with pytest.raises(ValueError, match="unknown prefix cache backend 'nope'"):
        PREFIX_CACHES.load("nope")


def test_cpu_matmul_reaches_the_model_and_moe() -> None:
    from swaserve.models.architectures import load_model

    bundle = load_model(engine_config_from_kwargs(None, device="cpu", cpu_matmul="fast"), progress=False)
    assert bundle.model.cpu_matmul == "fast" and bundle.model.moe.cpu_matmul == "fast"
    assert type(bundle.model.attn).__name__ == "TorchAttentionBackend" and not bundle.model._glue


def test_native_path_picks_the_native_attention_and_glue() -> None:
    from swaserve.engine.quant import native
    from swaserve.models.architectures import load_model

    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    cfg = engine_config_from_kwargs(None, device="cpu", cpu_matmul="native")
    model = load_model(cfg, progress=False).model
    assert type(model.attn).__name__ == "NativeAttentionBackend" and model._glue
    cfg = engine_config_from_kwargs(None, device="cpu", cpu_matmul="native", attention_backend="torch")
    assert type(load_model(cfg, progress=False).model.attn).__name__ == "TorchAttentionBackend"
