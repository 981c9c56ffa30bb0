"""Attention backends by name, imported lazily: torch (reference, CPU), native (CPU decode from the pool,
engine/attention/native_backend.py) and triton (CUDA).

`ATTENTION_BACKENDS.choices` is what `--attention-backend` accepts; `auto` = triton on CUDA, torch
elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from swaserve.engine.registry import Registry

if TYPE_CHECKING:
    import torch

    from swaserve.engine.attention.base import AttentionBackend


def _auto(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention", _auto)
ATTENTION_BACKENDS.register("torch", "swaserve.engine.attention.torch_backend:TorchAttentionBackend")
ATTENTION_BACKENDS.register("native", "swaserve.engine.attention.native_backend:NativeAttentionBackend")
ATTENTION_BACKENDS.register("triton", "swaserve.engine.attention.triton_backend:TritonAttentionBackend")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Build the attention backend `name` ("auto" resolved for `device`); ValueError for an unknown name."""
    return ATTENTION_BACKENDS.load(ATTENTION_BACKENDS.resolve(name, device))()
