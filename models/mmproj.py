"""Gemma 4 vision mmproj GGUF files, llama.cpp's layout (`llama-server --mmproj FILE`, projector `gemma4v`).

Verified against llama.cpp sources:

- Tensor names: gguf-py/gguf/constants.py + gguf-py/gguf/tensor_mapping.py (the `gguf` 0.19.0 package
  installed here resolves them: `get_tensor_name_map(MODEL_ARCH.MMPROJ, n)`), as convert_hf_to_gguf.py's
  `Gemma4VisionAudioModel` maps the HF checkpoint:
  `v.patch_embd.weight` (HF `patch_embedder.input_proj` [D, p*p*3] reshaped to the conv kernel
  [D, 3, p, p]: `reshape(D, p, p, 3).permute(0, 3, 1, 2)`), `v.position_embd.weight` [2, P, D] (kept
  F32), `v.blk.{i}.{attn_q,attn_k,attn_v,attn_out,attn_q_norm,attn_k_norm,ln1,attn_post_norm,ln2,
  ffn_post_norm,ffn_gate,ffn_up,ffn_down}.weight`, `v.std_bias`, `v.std_scale` (no `.weight` suffix;
  tools/mtmd/clip-impl.h TN_STD_BIAS / TN_STD_SCALE), `mm.input_projection.weight` [T, D]
  (clip-impl.h TN_MM_INP_PROJ). Gemma4ClippableLinear bounds are 1-element tensors named after the
  weight with `.input_min/.input_max/.output_min/.output_max` (tools/mtmd/clip.cpp, the GEMMA4V case of
  load_tensors, `clamp_info_map`; the converter unsqueezes the HF scalars to 1-D).
- Metadata keys (tools/mtmd/clip-impl.h): clip.projector_type (value "gemma4v",
  gguf VisionProjectorType.GEMMA4V; the converter writes clip.vision.projector_type, the key for files
  with both audio and vision; this loader accepts either), clip.has_vision_encoder,
  clip.vision.{embedding_length, feed_forward_length, block_count, projection_dim, image_size,
  patch_size, image_mean, image_std}, clip.vision.attention.{head_count, head_count_kv, head_dim,
  layer_norm_epsilon}, clip.vision.projector.scale_factor (clip.cpp reads it as the gemma4v pooling
  kernel, default 3), clip.use_gelu.
- Behaviour llama.cpp hard-codes for gemma4v (clip.cpp load_hparams): rope_theta 100, pooling 3 unless
  scale_factor says otherwise, image_size unused (the converter writes 224), mean 0 / std 1 (the graph
  maps [0, 1] to [-1, 1] itself, tools/mtmd/models/gemma4v.cpp).

Not llama.cpp keys (swaserve's own, optional, read with defaults): `swaserve.vision.rope_theta`
(default 100), `swaserve.vision.max_soft_tokens` (default 280; llama.cpp fixes its own token limits) and
`swaserve.vision.bidirectional_attention` (default true: llama.cpp decodes gemma4v image tokens
non-causally, mtmd_decode_use_non_causal; false = causal, what transformers does for a text config without
`use_bidirectional_attention: "vision"`).
Nothing here is guessed beyond those keys and writing clip.use_gelu = true (the key is llama.cpp's;
that gemma4v needs it set is inferred from the model's gelu-tanh MLP and clip.cpp's ffn_op selection).

A combined file (`combine_gguf`: the text model's keys and tensors plus the mmproj's `clip.*` /
`swaserve.vision.*` keys and `v.*` / `mm.*` tensors) is swaserve's: llama.cpp's converter writes the
projector as a separate file only (`--mmproj`), and its text loader counts tensors
(llama_model_loader::done_getting_tensors, "wrong number of tensors") so it refuses such a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from swaserve.models.gemma4_vision import LINEARS, VisionConfig, expected_shapes

PROJECTOR = "gemma4v"
_F32_ALWAYS = ("v.position_embd.weight", "v.std_bias", "v.std_scale")
_HF_LAYER = {
    "self_attn.q_proj.linear": "attn_q", "self_attn.k_proj.linear": "attn_k",
    "self_attn.v_proj.linear": "attn_v", "self_attn.o_proj.linear": "attn_out",
    "mlp.gate_proj.linear": "ffn_gate", "mlp.up_proj.linear": "ffn_up", "mlp.down_proj.linear": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "ln1", "post_attention_layernorm": "attn_post_norm",
    "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ffn_post_norm",
}


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]].tolist()[0]
    if f.types and f.types[0] == gguf.GGUFValueType.FLOAT32:
        return float(str(np.float32(v)))  # the shortest decimal of the float32: 1e-06, not 9.99999997e-07
    return v


def load_mmproj(path: str | Path) -> tuple[VisionConfig, dict[str, np.ndarray]]:
    """Read a gemma4v mmproj GGUF: its VisionConfig and float32 tensors keyed by GGUF name.

    A file that is not one (a text model, another projector type, a missing or misshapen tensor) raises
    ValueError naming the problem and the file."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is "not a GGUF"
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    ptype = _field(reader, "clip.projector_type") or _field(reader, "clip.vision.projector_type")
    if ptype is None:
        arch = _field(reader, "general.architecture")
        raise ValueError(f"{path}: not an mmproj file (no clip.projector_type; "
                         f"general.architecture={arch!r})")
    if ptype != PROJECTOR:
        raise ValueError(f"{path}: projector type {ptype!r}, expected {PROJECTOR!r} (Gemma 4 vision)")
    if _field(reader, "clip.has_vision_encoder") is False:
        raise ValueError(f"{path}: clip.has_vision_encoder is false")

    def need(key: str) -> Any:
        v = _field(reader, key)
        if v is None:
            raise ValueError(f"{path}: missing metadata key {key}")
        return v

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if not t.name.startswith(("v.", "mm.")) or t.name.startswith("mm.a."):  # skip text/audio tensors
            continue
        data = gguf.quants.dequantize(t.data, t.tensor_type)  # any stored type -> float32
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml ne order -> numpy order
        tensors[t.name] = np.array(data, dtype=np.float32).reshape(shape)  # an owned, writable copy
    heads = int(need("clip.vision.attention.head_count"))
    hidden = int(need("clip.vision.embedding_length"))
    pos = tensors.get("v.position_embd.weight")
    if pos is None:
        raise ValueError(f"{path}: missing tensor v.position_embd.weight")
    cfg = VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(need("clip.vision.feed_forward_length")),
        num_layers=int(need("clip.vision.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "clip.vision.attention.head_count_kv") or heads),
        head_dim=int(_field(reader, "clip.vision.attention.head_dim") or hidden // heads),
        patch_size=int(need("clip.vision.patch_size")),
        pooling_kernel_size=int(_field(reader, "clip.vision.projector.scale_factor") or 3),
        position_embedding_size=int(pos.shape[1]),
        rms_norm_eps=float(need("clip.vision.attention.layer_norm_epsilon")),
        rope_theta=float(_field(reader, "swaserve.vision.rope_theta") or 100.0),
        standardize="v.std_bias" in tensors and "v.std_scale" in tensors,
        text_hidden_size=int(need("clip.vision.projection_dim")),
        max_soft_tokens=int(_field(reader, "swaserve.vision.max_soft_tokens") or 280),
        bidirectional_attention=_field(reader, "swaserve.vision.bidirectional_attention") in (None, True),
    )
    for name, shape in expected_shapes(cfg).items():
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name}")
        if tensors[name].shape != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tensors[name].shape}, expected {shape}")
    return cfg, tensors


def has_vision(meta: dict[str, Any]) -> bool:
    """Whether a GGUF's metadata (models/gguf_loader.py GGUFFile.metadata) carries a projector's keys."""
    return "clip.projector_type" in meta or "clip.vision.projector_type" in meta


def combine_gguf(model_path: str | Path, mmproj_path: str | Path, out_path: str | Path) -> None:
    """Write `out_path`: the text model GGUF with the mmproj's clip.* / swaserve.vision.* keys and its
    tensors appended (stored bytes copied as they are), a single file `load_mmproj` reads too."""
    text, proj = gguf.GGUFReader(model_path), gguf.GGUFReader(mmproj_path)
    if has_vision({k: None for k in text.fields}):
        raise ValueError(f"{model_path}: already carries a projector")
    if not has_vision({k: None for k in proj.fields}):
        raise ValueError(f"{mmproj_path}: not an mmproj file (no clip.projector_type)")
    arch = _field(text, "general.architecture")
    w = gguf.GGUFWriter(str(out_path), arch)  # writes general.architecture itself
    align = _field(text, "general.alignment")
    if align is not None:
        w.data_alignment = int(align)
    fields = [f for f in text.fields.values() if not f.name.startswith("GGUF.")
              and f.name != "general.architecture"]
    fields += [f for f in proj.fields.values() if f.name.startswith(("clip.", "swaserve.vision."))]
    for f in fields:
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    tensors = list(text.tensors) + [t for t in proj.tensors if t.name.startswith(("v.", "mm."))]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"{model_path} and {mmproj_path} share tensor names")
    for t in tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.data)
    w.close()


def write_mmproj(path: str | Path, cfg: VisionConfig, tensors: dict[str, np.ndarray], *,
                 dtype: type = np.float16) -> None:
    """Write a gemma4v mmproj GGUF llama.cpp can load: matrices as `dtype` (float16 or float32), norms,
    the position table, std and clamp scalars as float32, and the clip.* metadata."""
    if dtype not in (np.float16, np.float32):
        raise ValueError(f"dtype must be float16 or float32, got {dtype}")
    for name, shape in expected_shapes(cfg).items():
        if name not in tensors:
            raise ValueError(f"write_mmproj: missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"write_mmproj: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(1 if dtype == np.float16 else 0)  # LlamaFileType MOSTLY_F16 / ALL_F32
    w.add_clip_projector_type(PROJECTOR)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(cfg.text_hidden_size)
    w.add_vision_image_size(224)  # unused by gemma4v; the converter writes 224 too
    w.add_vision_patch_size(cfg.patch_size)
    w.add_vision_embedding_length(cfg.hidden_size)
    w.add_vision_feed_forward_length(cfg.intermediate_size)
    w.add_vision_block_count(cfg.num_layers)
    w.add_vision_head_count(cfg.num_heads)
    w.add_uint32("clip.vision.attention.head_count_kv", cfg.num_kv_heads)
    w.add_uint32("clip.vision.attention.head_dim", cfg.head_dim)
    w.add_vision_attention_layernorm_eps(cfg.rms_norm_eps)
    w.add_vision_image_mean([0.0, 0.0, 0.0])
    w.add_vision_image_std([1.0, 1.0, 1.0])
    w.add_uint32("clip.vision.projector.scale_factor", cfg.pooling_kernel_size)
    w.add_bool("clip.use_gelu", True)
    w.add_float32("swaserve.vision.rope_theta", float(cfg.rope_theta))
    w.add_uint32("swaserve.vision.max_soft_tokens", cfg.max_soft_tokens)
    w.add_bool("swaserve.vision.bidirectional_attention", cfg.bidirectional_attention)
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        keep_f32 = arr.ndim <= 1 or name in _F32_ALWAYS
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32 if keep_f32 else dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_vision_config(text_hidden_size: int) -> VisionConfig:
    """A small tower for the demo model and tests: 64 wide, 2 layers, at most 64 soft tokens/image."""
    return VisionConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
        patch_size=16, pooling_kernel_size=3, position_embedding_size=256, rms_norm_eps=1e-6,
        rope_theta=100.0, standardize=True, text_hidden_size=text_hidden_size, max_soft_tokens=64,
    )


def random_vision(cfg: VisionConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights with a sane scale: outputs finite, O(1), different per image."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1 and name.startswith("v.blk."):  # RMSNorm scales around 1
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "v.std_bias":
            arr = 0.1 * rng.standard_normal(shape)
        elif name == "v.std_scale":
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "v.position_embd.weight":
            arr = 0.02 * rng.standard_normal(shape)
        else:  # matrices: variance-preserving over the input width
            fan_in = int(np.prod(shape[1:]))
            arr = rng.standard_normal(shape) / np.sqrt(fan_in)
        out[name] = arr.astype(np.float32)
    return out


def hf_state_to_gguf(state_dict: dict[str, Any], hf_vision_config: Any) -> dict[str, np.ndarray]:
    """Map a transformers Gemma4 state dict (`model.vision_tower.*`, `model.embed_vision.*`) to mmproj
    GGUF names and layouts, as llama.cpp's converter does. Clamp bounds that are +-inf (clipping off)
    are left out; finite ones become 1-element tensors."""

    def arr(key: str) -> np.ndarray:
        return state_dict[key].detach().float().cpu().numpy()

    c = hf_vision_config
    tower, D, p = "model.vision_tower.", c.hidden_size, c.patch_size
    out = {
        "v.patch_embd.weight": arr(tower + "patch_embedder.input_proj.weight")
        .reshape(D, p, p, 3).transpose(0, 3, 1, 2).copy(),
        "v.position_embd.weight": arr(tower + "patch_embedder.position_embedding_table"),
        "mm.input_projection.weight": arr("model.embed_vision.embedding_projection.weight"),
    }
    if getattr(c, "standardize", False):
        out["v.std_bias"] = arr(tower + "std_bias")
        out["v.std_scale"] = arr(tower + "std_scale")
    for i in range(c.num_hidden_layers):
        pre = f"{tower}encoder.layers.{i}."
        for hf, ours in _HF_LAYER.items():
            out[f"v.blk.{i}.{ours}.weight"] = arr(pre + hf + ".weight")
            if ours in LINEARS:
                for bound in ("input_min", "input_max", "output_min", "output_max"):
                    key = pre + hf.removesuffix(".linear") + "." + bound
                    if key in state_dict and np.isfinite(v := arr(key).reshape(-1)).all():
                        out[f"v.blk.{i}.{ours}.{bound}"] = v.astype(np.float32)
    return out


def vision_config_from_hf(hf_vision_config: Any, text_hidden_size: int, max_soft_tokens: int = 280,
                          use_bidirectional_attention: str | None = None) -> VisionConfig:
    """The VisionConfig of a transformers Gemma4VisionConfig; `use_bidirectional_attention`: the text
    config's field of that name ("vision": bidirectional image attention; None: causal)."""
    if use_bidirectional_attention not in (None, "vision"):
        raise ValueError(f"use_bidirectional_attention {use_bidirectional_attention!r} is not supported "
                         "(None or 'vision')")
    c = hf_vision_config
    return VisionConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        patch_size=c.patch_size, pooling_kernel_size=c.pooling_kernel_size,
        position_embedding_size=c.position_embedding_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(c.rope_parameters["rope_theta"]), standardize=bool(c.standardize),
        text_hidden_size=text_hidden_size, max_soft_tokens=max_soft_tokens,
        bidirectional_attention=use_bidirectional_attention == "vision",
    )
