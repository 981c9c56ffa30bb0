"""One frozen config chain, built once from the CLI (engine/args.py) or from LLM(**kwargs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LayerType = Literal["sliding", "full"]


@dataclass(frozen=True)
class ModelConfig:
    """Gemma 4 text-model hyperparameters, read from GGUF metadata (models/gguf_loader.py)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[LayerType, ...]  # per layer; the last is always "full"
    head_dim_swa: int  # 256 on the real model
    head_dim_full: int  # 512
    num_kv_heads_swa: int  # 8
    num_kv_heads_full: int  # 2
    sliding_window: int  # 1024: query i sees keys k with i - W < k <= i
    intermediate_size: int  # dense MLP ("shared expert"), 2112
    moe_intermediate_size: int  # per expert, 704
    num_experts: int  # 128
    top_k_experts: int  # 8
    rms_norm_eps: float = 1e-6
    rope_theta_swa: float = 1e4
    rope_theta_full: float = 1e6
    rope_dims_swa: int = 256  # rotated dims on sliding layers (all of head_dim_swa)
    rope_dims_full: int = 512
    # "proportional" rope of full layers: inv_freq[i] = 1/theta^(2i/head_dim_full) for i < this
    # many pairs, 0 beyond (from rope_freqs.weight: 1.0 then 1e30). 64 on the real model.
    rope_full_rotated_pairs: int = 64
    final_logit_softcap: float | None = 30.0
    context_length: int = 131072
    attention_k_eq_v_full: bool = True  # full layers have no v_proj: V is the raw K projection
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full"]

    @property
    def swa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "sliding"]

    def group_index(self, layer: int) -> int:
        """Index of `layer` within its pool group (full or sliding)."""
        kind = self.layer_types[layer]
        return sum(1 for t in self.layer_types[:layer] if t == kind)


KVDtype = Literal["auto", "bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    kv_cache_dtype: KVDtype = "auto"
    # Pool sizes in tokens; None = derive from kv_cache_memory_gb and swa_full_tokens_ratio.
    full_tokens: int | None = None
    swa_tokens: int | None = None
    kv_cache_memory_gb: float | None = None  # total budget for both pools; None = backend default
    swa_full_tokens_ratio: float = 0.25  # SWA tokens / full tokens when sizing from memory
    cache_type: Literal["radix", "naive"] = "radix"
    swa_retain_budget: int = 512  # tokens of divergence before an anchor whose window is kept
    swa_retain_policy: Literal["lazy", "eager"] = "lazy"


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_queued_requests: int = 1024  # beyond this, submit() raises EngineOverloaded (HTTP 503)
    context_length: int | None = None  # None = the model's context_length


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # a GGUF; None = the demo model (generated once, cached)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    moe_backend: Literal["auto", "torch", "triton", "offload"] = "auto"
    moe_cache_size: int = 0  # experts kept on the GPU by the offload backend (0 = auto)
    device: str = "auto"  # "auto" = cuda when available else cpu
    cpu_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default (all cores)
    seed: int = 0
