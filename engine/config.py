"""One frozen config chain, built once from the CLI (engine/args.py) or from LLM(**kwargs).

Each engine setting is declared once, here: its default, and (in the field's metadata, see
`option`) the flag that sets it, the flag's help and its bounds. engine/args.py builds the argparse
flags and both config builders from these declarations; choices come from the `Literal` type or,
for backends and the prefix cache, from their registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal

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


# KV storage types (engine/attention/kv_format.py); auto = bf16 on CUDA, q8_0 on CPU (fp16 with
# --cpu-matmul exact)
KVDtype = Literal["auto", "bf16", "fp16", "fp32", "q8_0", "fp8_e4m3"]
KVSideDtype = Literal["bf16", "fp16", "fp32", "q8_0", "fp8_e4m3"]
SIZING_RATIO = 0.25  # SWA tokens per full token when sizing the default or a --max-total-tokens arena
CpuMatmul = Literal["native", "exact", "fast"]  # see EngineConfig.cpu_matmul


def option(default: Any = MISSING, flag: str | None = None, *, help: str | None = None,
           min: float | None = None, max: float | None = None, min_exclusive: bool = False,
           backends: str | None = None, default_factory: Callable[[], Any] | None = None) -> Any:
    """A config field and the command-line flag that sets it: `flag` (its words, joined by `_`, name
    the argparse attribute), `help`, numeric bounds checked when the flag is parsed (`min` <= v, or
    `min` < v with min_exclusive; v <= `max`). Choices are the field's Literal values, or for
    `backends="attention" | "moe" | "cache"` the names registered in that family (engine/args.py reads
    the registry, so this module imports no backend package)."""
    meta = {"flag": flag, "help": help, "min": min, "max": max, "min_exclusive": min_exclusive,
            "backends": backends}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class VisionSpec:
    """What the server needs of the loaded image encoder (models/gemma4_vision.py) to prepare images:
    the preprocessing's shapes and the prompt's image token ids (begin / end None: not in the vocab)."""

    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    image_token_id: int
    boi_token_id: int | None
    eoi_token_id: int | None
    # an image's soft tokens attend to each other on the sliding layers (Req.attn_blocks)
    bidirectional_attention: bool = False


@dataclass(frozen=True)
class CacheConfig:
    cache_type: str = option(
        "radix", "--cache-type", backends="cache",
        help="radix: SWA-aware prefix cache; naive: no cross-request reuse")
    page_size: int = option(16, "--page-size", min=1)
    kv_cache_dtype: KVDtype = option(
        "auto", "--kv-cache-dtype",
        help="KV cache storage type of K and V: auto (bf16 on CUDA; q8_0 on CPU, fp16 with --cpu-matmul "
             "exact), bf16, fp16, fp32, q8_0 "
             "(blocks of 32 int8 values with an fp16 scale, llama.cpp's Q8_0: 1.0625 bytes a value) or "
             "fp8_e4m3 (CUDA, scale 1.0)")
    # per-side overrides (llama.cpp's --cache-type-k / --cache-type-v); None = kv_cache_dtype
    kv_cache_dtype_k: KVSideDtype | None = option(
        None, "--kv-cache-dtype-k", help="storage type of K only (default: --kv-cache-dtype)")
    kv_cache_dtype_v: KVSideDtype | None = option(
        None, "--kv-cache-dtype-v", help="storage type of V only (default: --kv-cache-dtype)")
    # total budget for both pools; None = backend default
    kv_cache_memory_gb: float | None = option(
        None, "--kv-cache-memory-gb", min=0, min_exclusive=True,
        help="memory for the KV arena both page kinds share (default: a fraction of free device memory)")
    # share of the device memory left after the weights that the KV arena takes (CUDA, no explicit size)
    kv_memory_fraction: float = option(
        0.85, "--kv-memory-fraction", min=0, max=1, min_exclusive=True,
        help="on CUDA without an explicit pool size: the share of the device memory left after the weights "
             "that the KV arena takes (default 0.85; alias --gpu-memory-utilization)")
    # Arena size in tokens of each kind held at once; None = from kv_cache_memory_gb (or the default).
    # The flag sets full_tokens, and engine/args.py sizes swa_tokens from it (swa_full_tokens_ratio, or
    # a quarter).
    full_tokens: int | None = option(
        None, "--max-total-tokens", min=1,
        help="size the KV memory for this many full-attention tokens plus a quarter as many SWA tokens "
             "(overrides --kv-cache-memory-gb)")
    swa_tokens: int | None = None
    # None: both page kinds share the KV arena freely; R: SWA pages capped at what a fixed split with
    # SWA tokens = R x full tokens would give them
    swa_full_tokens_ratio: float | None = option(
        None, "--swa-full-tokens-ratio", min=0, max=1, min_exclusive=True,
        help="cap the SWA share of the KV memory at a fixed split with SWA tokens = R x full tokens "
             "(default: no cap, the split follows the workload)")
    swa_retain_budget: int = option(
        512, "--swa-retain-budget", min=0,
        help="tokens of divergence before an anchor whose SWA window is kept (default 512)")
    swa_retain_policy: Literal["lazy", "eager"] = option(
        "lazy", "--swa-retain-policy",
        help="lazy: evict SWA only under pressure; eager: trim at finish like the seed engine")
    # the second KV tier: pages evicted from the arena go to a memory-mapped file in this directory and come
    # back on a prefix hit instead of being recomputed (engine/kvcache/tier/index.py); None = no tier
    kv_offload_dir: str | None = option(
        None, "--kv-offload-dir",
        help="directory for the second KV tier: evicted prefix pages are written to a memory-mapped file "
             "there and promoted back on a hit instead of recomputed (default: no tier)")
    kv_offload_gb: float = option(
        8.0, "--kv-offload-gb", min=0, min_exclusive=True,
        help="size of the second KV tier's file with --kv-offload-dir (default 8)")
    # the host-memory level in front of that file (pinned on CUDA); None = 4 GiB on CUDA, off on CPU (where
    # the OS page cache holds the file); off still stages evicted pages in 256 MiB for the background writer
    kv_offload_host_gb: float | None = option(
        None, "--kv-offload-host-gb", min=0,
        help="host memory (pinned on CUDA) in front of the --kv-offload-dir file: evicted pages land there "
             "and a background thread writes them to the file; hits there are promoted with a plain copy "
             "(default: 4 on CUDA, 0 = off on CPU)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = option(64, "--max-running-requests", min=1)
    # token budget of one step (prefill chunks + decodes)
    chunked_prefill_size: int = option(2048, "--chunked-prefill-size", min=1)
    # engine/scheduler/admission.py: while others run, a request whose pages would evict a cached window
    # predicted to be reused soon may wait (at most what recomputing that reuse would cost), later ones first;
    # auto: the engine builder picks cache-aware on CPU, fcfs on CUDA (a Scheduler built directly: fcfs)
    admission_policy: Literal["auto", "fcfs", "cache-aware"] = option(
        "auto", "--admission-policy",
        help="auto (default): cache-aware on CPU, fcfs on CUDA; fcfs: strict arrival order; cache-aware: "
             "while others run, a request whose pages would evict a cached SWA window about to be reused "
             "waits (no longer than recomputing that reuse would take, from measured step times) and later "
             "requests go first; pays where prefill is slow against a decode step (CPU)")
    admission_max_wait: int | None = option(
        None, "--admission-max-wait", min=0,
        help="cache-aware admission: at most this many scheduler steps of waiting (default: the measured "
             "bound alone; nothing waits before it is measured)")
    # beyond this, submit() raises EngineOverloaded (HTTP 503)
    max_queued_requests: int = option(1024, "--max-queued-requests", min=1)
    context_length: int | None = option(None, "--context-length", min=1)  # None = the model's


def _debug_checks_from_env() -> bool:
    return os.environ.get("SWASERVE_DEBUG", "") not in ("", "0")


@dataclass(frozen=True)
class EngineConfig:
    # a GGUF; None = the demo model (generated once, cached)
    model_path: str | None = option(
        None, "--model", help="path to a Gemma 4 GGUF (default: the built-in demo model)")
    device: str = option("auto", "--device", help="cpu, cuda, cuda:N or auto (default)")  # auto: cuda if any
    # the image encoder (llama.cpp's gemma4v mmproj GGUF); None = none, except the demo model's own
    mmproj: str | None = option(
        None, "--mmproj", help="a Gemma 4 vision projector GGUF (llama.cpp's mmproj, projector gemma4v): "
        "requests may then carry images (default: none; the built-in demo model brings its own)")
    no_mmproj: bool = option(False, "--no-mmproj", help="serve text only, even with the demo model's encoder")
    image_cache_size: int = option(
        64, "--image-cache-size", min=0,
        help="encoded images kept by content hash, so that a fan-out over one image encodes it once")
    # soft tokens of uncached images one step may start encoding (engine/scheduler/encoder_budget.py)
    image_encoder_budget: int | None = option(
        None, "--image-encoder-budget", min=1,
        help="soft tokens of new (not yet encoded) images one step may encode; a chunk reaching an image "
             "past it stops before the image (default: --chunked-prefill-size; the first new image of a "
             "step always runs)")
    attention_backend: str = option("auto", "--attention-backend", backends="attention")
    moe_backend: str = option("auto", "--moe-backend", backends="moe")
    moe_cache_size: int = option(
        0, "--moe-cache-size", min=0,
        help="experts kept on the GPU by the offload backend (0 = size from free memory)")
    seed: int = option(0, "--seed", help="engine seed for requests without a seed")
    # each step's thread count follows the cores other processes leave free (engine/runner/threads.py), at
    # most cpu_threads; `swaserve serve` turns it on when --cpu-threads is not given
    cpu_threads_follow_load: bool = option(
        False, "--cpu-threads-follow-load",
        help="each step's CPU thread count follows the cores other processes leave free, up to "
             "--cpu-threads (on by default for `serve` without --cpu-threads; a fixed --cpu-threads N "
             "turns it off there)")
    # torch intra-op threads on CPU; None = torch's default (all cores)
    cpu_threads: int | None = option(
        None, "--cpu-threads", min=1,
        help="torch threads for CPU compute, fixed (default: all cores, and `serve` follows the cores "
             "other processes leave free, step by step; with --no-engine-process it leaves one core "
             "to the HTTP server)")
    # CPU block-type linears with fp32 activations: "native" (integer kernels with 8-bit activations,
    # llama.cpp's numerics: engine/quant/native.py for Q4_0, weights repacked at load;
    # engine/quant/native_k.py for Q8_0, Q4_1, Q5_0, Q5_1, IQ4_NL, the K types, IQ4_XS, on
    # the stored rows; exact for the other types or when a kernel cannot be built), "exact" (dequantize +
    # fp32 matmul: the oracle) or "fast" (torch's bf16 int4 kernel);
    # bf16 activations always take the int4 kernel. The model and the MoE backend get it at
    # construction (models/architectures.py) and pass it to each linear.
    cpu_matmul: CpuMatmul = option(
        "native", "--cpu-matmul",
        help="CPU quantized linears of fp32 activations: native (default: integer kernels with 8-bit "
             "activations, llama.cpp's numerics; the IQ1-3 codebook types stay exact), exact (dequantize + "
             "fp32 matmul) or fast (bf16 int4 kernel, Q4_0)")
    # prefill rows through the native one-row decode kernel (models/architectures.py sets
    # NativeAttentionBackend.row_prefill): prompt KV then has the bits a decode step would have written
    batch_invariant: bool = option(
        False, "--batch-invariant",
        help="CPU native path: compute prefill attention one row at a time as decode does, so a prefix "
             "written by decode steps (a generated turn) reused from the cache gives a scratch prefill's "
             "answer too (prompt prefixes are chunk-invariant without it; prefill 1.25-1.8x slower, "
             "docs/cache.md)")
    no_cuda_graphs: bool = option(
        False, "--no-cuda-graphs",
        help="CUDA: run decode steps eagerly instead of replaying one captured graph per batch-size "
             "bucket (engine/runner/cuda_graphs.py; graphs are on by default with the triton backends)")
    # one chat-template render's budget (engine/text/template_sandbox.py RenderLimits); None = the sandbox's
    # defaults (RENDER_TIME_LIMIT_S = 10 s, RENDER_MAX_CHARS = 16 Mi), read when each render starts
    chat_template_timeout: float | None = option(
        None, "--chat-template-timeout", min=0, min_exclusive=True,
        help="seconds of CPU time (the rendering thread's) one chat-template render may take; past it the "
             "request gets a 400 naming the template (default 10)")
    chat_template_max_chars: int | None = option(
        None, "--chat-template-max-chars", min=1,
        help="characters one chat-template render may produce, or build in any string, list or dict; "
             "past it the request gets a 400 naming the template (default 16777216 = 16 Mi)")
    # check the cache and pool invariants after every step (slow); the default follows $SWASERVE_DEBUG,
    # read when the config (or the flag parser) is built
    debug_checks: bool = option(
        default_factory=_debug_checks_from_env, flag="--debug-checks",
        help="check cache and pool invariants after every step (slow; default: on when $SWASERVE_DEBUG "
             "is set)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
