"""GGUF writer for Gemma 4 models (llama.cpp `gemma4` keys, names, shapes and types), streamed tensor by
tensor. Used by models/demo/tiny.py; the loader (models/gguf_loader.py) reads what this writes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from swaserve.engine.config import ModelConfig
from swaserve.models.demo.quant_mix import QTYPE_CHOICES, file_type, fit, is_matrix, tensor_types
from swaserve.models.gemma4_layout import ARCH

log = logging.getLogger(__name__)

# --qtype: one stored type everywhere, or a llama.cpp mix (models/demo/quant_mix.py)
WRITE_QTYPES = QTYPE_CHOICES
# block types gguf-py can quantize float weights to; the others are written as random blocks
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# tokenizer keys whose GGUF type llama.cpp checks (others are inferred from the Python value)
_TOKENIZER_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    "tokenizer.ggml.tokens": (GGUFValueType.ARRAY, GGUFValueType.STRING),
    "tokenizer.ggml.merges": (GGUFValueType.ARRAY, GGUFValueType.STRING),
    "tokenizer.ggml.scores": (GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "tokenizer.ggml.token_type": (GGUFValueType.ARRAY, GGUFValueType.INT32),
    "tokenizer.ggml.eos_token_ids": (GGUFValueType.ARRAY, GGUFValueType.INT32),
}


@dataclass
class RawTensor:
    """A tensor already in GGUF stored form: `data` is what goes to disk (uint8 rows for block types,
    or a numpy array of the type's dtype); `shape` is the torch-order element shape."""

    qtype: str
    data: np.ndarray
    shape: tuple[int, ...]


def tensor_qtype(name: str, shape: tuple[int, ...], qtype: str) -> str:
    """Stored type of tensor `name` in a one-type file: `qtype` for large matrices (llama.cpp's
    fallback where a row is not whole blocks), F32 for norms/router/scalars."""
    return fit(qtype, shape[-1]) if is_matrix(name, shape) else "F32"


def stored_nbytes(shape: tuple[int, ...], qtype: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return int(np.prod(shape, dtype=np.int64)) // block * size


def encode(arr: np.ndarray, qtype: str) -> np.ndarray:
    """fp32 array (torch order) -> the stored bytes/array of `qtype`."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == "F32":
        return arr
    if qtype == "F16":
        return arr.astype(np.float16)
    if qtype not in QUANTIZABLE and qtype != "BF16":
        raise ValueError(f"cannot quantize float weights to {qtype} (gguf has no quantizer for it); "
                         "write random blocks instead (models/demo/random_blocks.py)")
    return quants.quantize(arr, GGMLQuantizationType[qtype])


def _value_type(key: str, val: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if key in _TOKENIZER_TYPES:
        return _TOKENIZER_TYPES[key]
    if isinstance(val, bool):
        return GGUFValueType.BOOL, None
    if isinstance(val, int):
        return (GGUFValueType.UINT32 if 0 <= val < 2**32 else GGUFValueType.INT64), None
    if isinstance(val, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(val, str):
        return GGUFValueType.STRING, None
    if isinstance(val, (list, tuple)):
        if not val:
            raise ValueError(f"metadata key {key!r}: empty arrays cannot be written")
        v0 = val[0]
        sub = (
            GGUFValueType.STRING if isinstance(v0, str)
            else GGUFValueType.BOOL if isinstance(v0, bool)
            else GGUFValueType.FLOAT32 if isinstance(v0, float)
            else GGUFValueType.INT32
        )
        return GGUFValueType.ARRAY, sub
    raise ValueError(f"metadata key {key!r}: cannot write a value of type {type(val).__name__}")


def add_model_metadata(w: GGUFWriter, cfg: ModelConfig, qtype: str, name: str) -> None:
    """The `gemma4.*` keys llama.cpp's gemma4 loader reads."""
    kv_heads = [cfg.num_kv_heads_swa if t == "sliding" else cfg.num_kv_heads_full for t in cfg.layer_types]
    w.add_name(name)
    w.add_file_type(file_type(qtype))
    w.add_quantization_version(2)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.top_k_experts)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(cfg.head_dim_full)
    w.add_value_length(cfg.head_dim_full)
    w.add_key_length_swa(cfg.head_dim_swa)
    w.add_value_length_swa(cfg.head_dim_swa)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([t == "sliding" for t in cfg.layer_types])
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    w.add_rope_freq_base(cfg.rope_theta_full)
    w.add_rope_freq_base_swa(cfg.rope_theta_swa)
    w.add_rope_dimension_count(cfg.rope_dims_full)
    w.add_rope_dimension_count_swa(cfg.rope_dims_swa)
    if cfg.final_logit_softcap is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcap)


def write_gguf(
    path: str,
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray | RawTensor],
    tokenizer_meta: Mapping[str, Any],
    qtype: str = "Q4_0",
    progress: bool = False,
    name: str = "swaserve-random-gemma4",
    embed_qtype: str | None = None,
) -> None:
    """Write a Gemma 4 GGUF: large matrices in `qtype` (one type, or a llama.cpp mix: see
    models/demo/quant_mix.py; `embed_qtype` overrides the token embedding's), norms/router/scalars F32,
    plus the model metadata and `tokenizer_meta` (tokenizer.* keys); a RawTensor keeps its own type.
    Tensors are fetched from `tensors` one at a time while writing (a lazy Mapping with a `shapes`
    attribute is never fully materialised)."""
    shapes: Mapping[str, tuple[int, ...]] | None = getattr(tensors, "shapes", None)
    raw_types: dict[str, str] = {}
    if shapes is None:
        shapes = {}
        for tname in tensors:
            val = tensors[tname]
            shapes[tname] = tuple(val.shape)
            if isinstance(val, RawTensor):
                raw_types[tname] = val.qtype
    types = tensor_types(shapes, qtype, embed_qtype) | raw_types
    plan = [(tname, tuple(shapes[tname]), types[tname]) for tname in tensors]

    w = GGUFWriter(path, ARCH)
    add_model_metadata(w, cfg, qtype, name)
    for key, val in tokenizer_meta.items():
        vtype, sub = _value_type(key, val)
        w.add_key_value(key, list(val) if isinstance(val, tuple) else val, vtype, sub_type=sub)
    for tname, shape, tq in plan:
        gq = GGMLQuantizationType[tq]
        w.add_tensor_info(tname, shape, np.dtype(np.float32), stored_nbytes(shape, tq), raw_dtype=gq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(stored_nbytes(s, q) for _, s, q in plan), unit="B", unit_scale=True,
                   desc=f"writing {path}")
    try:
        for tname, shape, tq in plan:
            val = tensors[tname]
            if isinstance(val, RawTensor):
                assert val.qtype == tq, (tname, val.qtype, tq)
                data = val.data
            else:
                assert tuple(val.shape) == shape, (tname, val.shape, shape)
                data = encode(val, tq)
            assert data.nbytes == stored_nbytes(shape, tq), (tname, data.nbytes)
            w.write_tensor_data(data)
            if bar is not None:
                bar.update(data.nbytes)
    finally:
        if bar is not None:
            bar.close()
        w.close()
