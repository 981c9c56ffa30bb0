"""GGUF architecture name -> loader and model builder; `load_model` builds the bundle the engine runs.

The file is mapped and parsed once (`open_gguf`): its `general.architecture` picks the entry, whose
loader reads the same opened file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swaserve.engine.attention.kv_format import kv_format_of
from swaserve.engine.config import EngineConfig
from swaserve.engine.model_api import CausalLM, ModelBundle, resolve_device
from swaserve.models.gguf_loader import GGUFError, GGUFFile, LoadedModel, load_gemma4, open_gguf

log = logging.getLogger("swaserve.models")


@dataclass(frozen=True)
class Architecture:
    load: Callable[[GGUFFile, bool], LoadedModel]  # (opened file, progress) -> config, weights, metadata
    build: Callable[[LoadedModel, EngineConfig, torch.device], CausalLM]


def _build_gemma4(loaded: LoadedModel, cfg: EngineConfig, device: torch.device) -> CausalLM:
    from swaserve.engine.attention import get_attention_backend
    from swaserve.engine.moe import get_moe_backend
    from swaserve.models.gemma4 import Gemma4Model

    act_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attn_name = cfg.attention_backend
    if attn_name == "auto" and device.type == "cpu" and cfg.cpu_matmul == "native":
        from swaserve.engine.quant import native

        attn_name = "native" if native.available() else "torch"  # decode attention from the pool
    attn = get_attention_backend(attn_name, device)
    if cfg.batch_invariant:
        if not hasattr(attn, "row_prefill"):
            raise ValueError(f"--batch-invariant needs the native CPU attention backend (--cpu-matmul native "
                             f"on CPU, --attention-backend auto or native), not {type(attn).__name__}")
        attn.row_prefill = True  # type: ignore[attr-defined]
    moe = get_moe_backend(cfg.moe_backend, loaded.config, loaded.weights.experts, device, cfg.moe_cache_size,
                          cfg.cpu_matmul)
    return Gemma4Model(loaded.config, loaded.weights, attn, moe, device, act_dtype, cfg.cpu_matmul)


ARCHITECTURES: dict[str, Architecture] = {
    "gemma4": Architecture(load=load_gemma4, build=_build_gemma4),
}


def load_model(cfg: EngineConfig, progress: bool = True) -> ModelBundle:
    """Load cfg.model_path (None = the built-in demo model) and build it on cfg.device."""
    path = cfg.model_path
    if path is None:
        from swaserve.models.demo.tiny import demo_model_path

        path = demo_model_path()
    file = open_gguf(path)
    arch_name = file.architecture
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise GGUFError(f"{path}: architecture {arch_name!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    device = resolve_device(cfg.device)
    kv_format_of(cfg.cache, device, cfg.cpu_matmul)  # a --kv-cache-dtype this device cannot serve fails now
    t0 = time.monotonic()
    log.info("loading %s", path)
    loaded = arch.load(file, progress)
    model = arch.build(loaded, cfg, device)
    name = "swaserve-demo" if cfg.model_path is None else Path(path).stem
    log.info("model %s built in %.1fs (%s, device %s)", name, time.monotonic() - t0, arch_name, device)
    meta: dict[str, Any] = loaded.metadata
    vision, spec, vision_path = _load_vision(cfg, loaded.config, meta, device, path)
    return ModelBundle(model=model, config=loaded.config, metadata=meta, name=name, path=path, device=device,
                       vision=vision, vision_spec=spec, vision_path=vision_path)


def _load_vision(cfg: EngineConfig, text_cfg: Any, meta: dict[str, Any], device: Any, model_path: str
                 ) -> tuple[Any, Any, str | None]:
    """The image encoder: --mmproj, else the model GGUF's own tower (a combined file), else the demo
    model's mmproj; (Gemma4Vision, VisionSpec, its file), or Nones with --no-mmproj or none found."""
    from swaserve.models.mmproj import has_vision, load_mmproj

    path = cfg.mmproj
    if cfg.no_mmproj:
        return None, None, None
    if path is None and has_vision(meta):
        path = model_path
    if path is None and cfg.model_path is None:
        from swaserve.models.demo.tiny import demo_mmproj_path

        path = demo_mmproj_path()
    if path is None:
        return None, None, None
    from swaserve.engine.config import VisionSpec
    from swaserve.models.gemma4_vision import Gemma4Vision

    vcfg, tensors = load_mmproj(path)
    if vcfg.text_hidden_size != text_cfg.hidden_size:
        raise ValueError(f"{path}: the projector writes {vcfg.text_hidden_size}-wide embeddings but the "
                         f"model's hidden size is {text_cfg.hidden_size}: not this model's mmproj")
    # the image tokens' ids, by one scan of the vocabulary (the engine builds the tokenizer itself)
    wanted = ("<|image|>", "<|image>", "<image|>")
    ids = {t: i for i, t in enumerate(meta.get("tokenizer.ggml.tokens") or ()) if t in wanted}
    if "<|image|>" not in ids:
        raise ValueError(f"--mmproj {path}: the model's vocabulary has no <|image|> token")
    spec = VisionSpec(vcfg.patch_size, vcfg.pooling_kernel_size, vcfg.max_soft_tokens, ids["<|image|>"],
                      ids.get("<|image>"), ids.get("<image|>"), vcfg.bidirectional_attention)
    where = " (in the model file)" if path == model_path else ""
    log.info("image encoder %s%s: %d layers, up to %d soft tokens an image, %s image attention",
             Path(path).name, where, vcfg.num_layers, vcfg.max_soft_tokens,
             "bidirectional" if vcfg.bidirectional_attention else "causal")
    return Gemma4Vision(vcfg, tensors, device), spec, path
