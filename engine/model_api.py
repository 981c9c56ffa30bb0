"""What the engine needs from a model. `models/` builds one (models.architectures.load_model); whoever
composes (the CLI, the server launch, `LLM`) hands it to the engine, which never imports `models/`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.config import ModelConfig, VisionSpec


class CausalLM(Protocol):
    """A decoder over the paged KV pools: one varlen batch in, hidden states and logits out."""

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        """input_ids [T] (the new tokens of every sequence, flat) -> fp32 hidden [T, H]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, V]."""
        ...

    def fused_path(self) -> bool:
        """Whether forward runs fused device kernels only (what a CUDA graph of a decode step captures)."""
        ...


@dataclass(frozen=True)
class ModelBundle:
    """A loaded model with what the engine reads beside it."""

    model: CausalLM
    config: ModelConfig
    metadata: Mapping[str, Any]  # GGUF metadata: tokenizer.*, tokenizer.chat_template, ...
    name: str  # the default served model name
    path: str  # the GGUF file
    device: torch.device
    vision: Any = None  # the image encoder (models/gemma4_vision.py Gemma4Vision), None: text only
    vision_spec: VisionSpec | None = None  # its preprocessing, for the server
    vision_path: str | None = None  # the encoder's GGUF (an mmproj, or `path` for a combined file)


def resolve_device(name: str) -> torch.device:
    """`auto` = cuda when available, else cpu; ValueError for a CUDA device on a machine without one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return dev


# GGUF generation metadata (written by llama.cpp's converters from the HF generation_config.json)
# -> SamplingParams field names
SAMPLING_METADATA = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def generation_defaults(metadata: Any) -> dict[str, float]:
    """The sampling defaults a GGUF declares (`general.sampling.*`), as SamplingParams fields."""
    out: dict[str, float] = {}
    for key, name in SAMPLING_METADATA.items():
        v = metadata.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = int(v) if name == "top_k" else float(v)
    return out
