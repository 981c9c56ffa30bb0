"""Load a Gemma 4 GGUF (architecture `gemma4`, llama.cpp names) memory-mapped through the `gguf` package.

`open_gguf` maps and parses a file once (metadata and tensor index); models/architectures.py reads the
architecture from it and hands the same GGUFFile to that architecture's loader (`load_gemma4`).
Every matrix (attention, dense MLP, experts, the token embedding that is also the tied lm_head) stays
in its stored form as a view of the mapped file (QWeight): F32/F16/BF16 and every block type with a
decoder in engine/quant/formats.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS and the
IQ1/IQ2/IQ3 codebook types). Nothing is converted at load, so the model computes with exactly the
weights the file defines. Norms, router, scales and scalars are small exact fp32 copies (any type gguf
can decode). A matrix of another type, and every other problem, is a GGUFError: one line naming the
key or tensor and the file.
"""

from __future__ import annotations

import logging
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, quants

from swaserve.engine.config import ModelConfig
from swaserve.engine.moe.base import ExpertWeights
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import supported
from swaserve.engine.quant.formats import FORMATS
from swaserve.models.gemma4_layout import ARCH, tensor_shapes
from swaserve.models.weights import Gemma4Weights, LayerWeights

log = logging.getLogger(__name__)

_NOT_DEQUANTIZABLE = {"F64", "I8", "I16", "I32", "I64", "Q8_1", "Q8_K", "Q1_0"}


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded as Gemma 4 (message: one line, names the key/tensor and file)."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Gemma4Weights
    metadata: dict[str, Any]
    path: str
    file_size: int


class _Reader(GGUFReader):
    """GGUFReader with fast metadata arrays: the stock reader parses arrays element by element
    (~30 s for a 262144-token vocabulary); here numeric arrays are one view sliced per element and
    string arrays are walked with struct. Same fields/parts layout as the stock reader."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        sub, n = GGUFValueType(int(itype[0])), int(alen[0])
        types = [GGUFValueType.ARRAY, sub]
        nptype = self.gguf_scalar_to_np.get(sub)
        raw = self.data.view(np.ndarray)  # plain ndarray slicing (no memmap subclass overhead)
        if nptype is not None:
            size = np.dtype(nptype).itemsize * n
            arr = raw[orig_offs + 12 : orig_offs + 12 + size].view(nptype)
            elems = [arr[i : i + 1] for i in range(n)]  # one part per element, as the stock reader
            return 12 + int(arr.nbytes), [itype, alen, *elems], list(range(2, n + 2)), types
        if sub != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        mv = memoryview(raw)
        parts: list = [itype, alen]
        offs = orig_offs + 12
        for _ in range(n):
            (slen,) = struct.unpack_from("<Q", mv, offs)
            parts.append(raw[offs : offs + 8].view(np.uint64))
            parts.append(raw[offs + 8 : offs + 8 + slen])
            offs += 8 + slen
        return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), types


@dataclass
class GGUFFile:
    """A GGUF mapped and parsed once: what the registry dispatches on and the loaders read."""

    path: str
    reader: GGUFReader  # holds the read-only memory map the stored-form weights are views of
    metadata: dict[str, Any]  # every key/value as plain Python (str, int, float, bool, list)
    tensors: dict[str, Any]  # GGUF tensor name -> the reader's tensor (name, type, shape, data)

    @property
    def architecture(self) -> Any:
        """general.architecture (None when missing)."""
        return self.metadata.get("general.architecture")


def _field_value(field: Any) -> Any:
    v = field.contents()
    if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(v, list):
        v = list(v)
    return v


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def open_gguf(path: str) -> GGUFFile:
    """Map and parse `path` (metadata and tensor index; no tensor data is read)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    try:
        reader = _Reader(path, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/... on garbage
        raise GGUFError(f"{path}: not a GGUF file ({type(e).__name__}: {e})") from None
    return GGUFFile(path, reader, _metadata(reader), {t.name: t for t in reader.tensors})


def read_metadata(path: str) -> dict[str, Any]:
    """Every GGUF key/value of `path` as plain Python (str, int, float, bool, list)."""
    return open_gguf(path).metadata


class _ArchMetadata:
    """The `gemma4.*` keys of a file's metadata, with one-line errors naming the file."""

    def __init__(self, meta: dict[str, Any], path: str):
        self.meta, self.path = meta, path

    def get(self, key: str, default: Any = None) -> Any:
        """`gemma4.<key>`; a missing key is an error unless a default is given."""
        full = f"{ARCH}.{key}"
        if full not in self.meta:
            if default is None:
                raise GGUFError(f"{self.path}: missing metadata key {full}")
            return default
        return self.meta[full]

    def scalar(self, key: str, n_layers: int, default: Any = None) -> Any:
        """A key that may be a per-layer array; must then be uniform."""
        v = self.get(key, default)
        if isinstance(v, list):
            if len(v) != n_layers or len(set(v)) != 1:
                raise GGUFError(f"{self.path}: metadata key {ARCH}.{key} = {v} "
                                "(per-layer values not supported)")
            v = v[0]
        return v


def _f32(v: Any) -> float:
    """A GGUF float32 as the decimal it was written from (1e-06, not 9.9999999747e-07)."""
    return float(str(np.float32(v)))


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{path}: general.architecture is {arch!r}, expected {ARCH!r}")
    m = _ArchMetadata(meta, path)
    n = int(m.get("block_count"))
    pat = m.get("attention.sliding_window_pattern")
    if isinstance(pat, list):
        if len(pat) != n:
            raise GGUFError(f"{path}: {ARCH}.attention.sliding_window_pattern has {len(pat)} entries, "
                            f"block_count is {n}")
        layer_types = tuple("sliding" if bool(p) else "full" for p in pat)
    else:  # period: every pat-th layer is full
        layer_types = tuple("full" if (i + 1) % int(pat) == 0 else "sliding" for i in range(n))
    if "full" not in layer_types or "sliding" not in layer_types:
        raise GGUFError(f"{path}: {ARCH}.attention.sliding_window_pattern needs both sliding and full layers")
    kvh = m.get("attention.head_count_kv")
    kvh = list(kvh) if isinstance(kvh, list) else [kvh] * n
    if len(kvh) != n:
        raise GGUFError(f"{path}: {ARCH}.attention.head_count_kv has {len(kvh)} entries, block_count is {n}")
    kv_swa = {k for k, t in zip(kvh, layer_types) if t == "sliding"}
    kv_full = {k for k, t in zip(kvh, layer_types) if t == "full"}
    if len(kv_swa) != 1 or len(kv_full) != 1:
        raise GGUFError(f"{path}: {ARCH}.attention.head_count_kv = {kvh} differs within a layer kind")
    d_full, d_swa = int(m.get("attention.key_length")), int(m.get("attention.key_length_swa"))
    for key, want in (("attention.value_length", d_full), ("attention.value_length_swa", d_swa)):
        if int(m.get(key, want)) != want:
            raise GGUFError(f"{path}: {ARCH}.{key} != key length {want} (not supported)")
    if int(m.get("embedding_length_per_layer_input", 0)) != 0 or int(m.get("attention.shared_kv_layers", 0)):
        raise GGUFError(f"{path}: per-layer inputs / shared KV layers (Gemma 4 E2B/E4B) are not supported")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: missing tensor token_embd.weight")
    vocab = int(tensors["token_embd.weight"].shape[1])
    toks = meta.get("tokenizer.ggml.tokens")
    if toks is not None and len(toks) != vocab:
        raise GGUFError(f"{path}: tokenizer.ggml.tokens has {len(toks)} entries but token_embd.weight has "
                        f"{vocab} rows")
    softcap = _f32(m.get("final_logit_softcapping", 0.0))
    eos = [int(meta.get("tokenizer.ggml.eos_token_id", 1))]
    eos += [int(i) for i in meta.get("tokenizer.ggml.eos_token_ids", []) if int(i) not in eos]
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=int(m.get("embedding_length")),
        num_layers=n,
        num_heads=int(m.scalar("attention.head_count", n)),
        layer_types=layer_types,  # type: ignore[arg-type]
        head_dim_swa=d_swa,
        head_dim_full=d_full,
        num_kv_heads_swa=int(kv_swa.pop()),
        num_kv_heads_full=int(kv_full.pop()),
        sliding_window=int(m.get("attention.sliding_window")),
        intermediate_size=int(m.scalar("feed_forward_length", n)),
        moe_intermediate_size=int(m.get("expert_feed_forward_length")),
        num_experts=int(m.get("expert_count")),
        top_k_experts=int(m.get("expert_used_count")),
        rms_norm_eps=_f32(m.get("attention.layer_norm_rms_epsilon")),
        rope_theta_swa=_f32(m.get("rope.freq_base_swa", 1e4)),
        rope_theta_full=_f32(m.get("rope.freq_base", 1e6)),
        rope_dims_swa=int(m.get("rope.dimension_count_swa", d_swa)),
        rope_dims_full=int(m.get("rope.dimension_count", d_full)),
        rope_full_rotated_pairs=_rotated_pairs(tensors, d_full, path),
        final_logit_softcap=softcap if softcap > 0 else None,
        context_length=int(m.get("context_length")),
        attention_k_eq_v_full=not any(
            f"blk.{i}.attn_v.weight" in tensors for i, t in enumerate(layer_types) if t == "full"),
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        eos_token_ids=tuple(eos),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    )


def _rotated_pairs(tensors: dict[str, Any], d_full: int, path: str) -> int:
    """Number of leading 1.0 factors in rope_freqs.weight (the rest must be >= 1e20: no rotation)."""
    t = tensors.get("rope_freqs.weight")
    if t is None:
        raise GGUFError(f"{path}: missing tensor rope_freqs.weight")
    _check_shape(t, (d_full // 2,), path)
    f = _as_numpy_f32(t, path)
    n = int(np.sum(f < 1e20))
    if not (np.all(f[:n] == 1.0) and np.all(f[n:] >= 1e20)):
        raise GGUFError(f"{path}: tensor rope_freqs.weight is not 1.0 x n then >= 1e20 "
                        "(unsupported rope factors)")
    return n


def _check_shape(t: Any, want: tuple[int, ...], path: str) -> None:
    got = tuple(int(x) for x in reversed(t.shape.tolist()))
    if got != want:
        raise GGUFError(f"{path}: tensor {t.name} has shape {got} (torch order), expected {want}")


def _as_numpy_f32(t: Any, path: str) -> np.ndarray:
    """Dequantize any supported tensor to fp32 numpy in torch-order element shape."""
    qt = t.tensor_type.name
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    if qt in _NOT_DEQUANTIZABLE:
        raise GGUFError(f"{path}: tensor {t.name} has unsupported type {qt}")
    if qt in ("F32", "F16"):
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    try:
        out = quants.dequantize(np.asarray(t.data), t.tensor_type)
        return out.reshape(shape).astype(np.float32, copy=False)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {t.name} has unsupported type {qt}") from None


def _torch_view(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only mapping: the tensors are never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def _qweight(t: Any, want: tuple[int, ...], path: str) -> QWeight:
    _check_shape(t, want, path)
    qt = t.tensor_type.name
    if not supported(qt):
        raise GGUFError(f"{path}: tensor {t.name} has unsupported type {qt} (matrices may be F32, F16, BF16, "
                        f"{', '.join(FORMATS)})")
    data = _torch_view(t.data)  # block types: uint8 [..., N, row bytes]; float types: [..., N, K]
    if qt == "BF16":
        data = data.view(torch.bfloat16).reshape(want)
    return QWeight(qt, want, data, t.name, mmapped=True)  # a view of the read-only file mapping


def _vector(t: Any, want: tuple[int, ...], path: str) -> torch.Tensor:
    _check_shape(t, want, path)
    return torch.from_numpy(np.array(_as_numpy_f32(t, path), dtype=np.float32, copy=True))


def _gate_up(tensors: dict[str, Any], i: int, cfg: ModelConfig, path: str) -> QWeight:
    e, ie, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fused = tensors.get(f"blk.{i}.ffn_gate_up_exps.weight")
    if fused is not None:
        return _qweight(fused, (e, 2 * ie, h), path)
    gate, up = (tensors.get(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up"))
    for name, t in (("gate", gate), ("up", up)):
        if t is None:
            raise GGUFError(f"{path}: missing tensor blk.{i}.ffn_gate_up_exps.weight "
                            f"(or blk.{i}.ffn_{name}_exps.weight)")
    g, u = _qweight(gate, (e, ie, h), path), _qweight(up, (e, ie, h), path)
    name = f"blk.{i}.ffn_gate_up_exps.weight"
    if g.qtype == u.qtype:  # concatenate the stored rows (one copy, at load)
        return QWeight(g.qtype, (e, 2 * ie, h), torch.cat([g.data, u.data], dim=1), name)
    # one QWeight holds one type: exact fp32 rows (4 bytes per weight; llama.cpp's converter writes the
    # fused tensor for gemma4, which has a single type, so this is for hand-made split files)
    log.warning("%s: blk.%d.ffn_gate_exps is %s but ffn_up_exps is %s; holding both as F32 (%.1f GB)",
                path, i, g.qtype, u.qtype, 2 * e * ie * h * 4 / 1e9)
    from swaserve.engine.quant.dequant import dequantize

    return QWeight("F32", (e, 2 * ie, h), torch.cat([dequantize(g), dequantize(u)], dim=1), name)


def read_config(path: str) -> ModelConfig:
    """The ModelConfig of a Gemma 4 GGUF from its metadata and tensor index (no tensor data is read)."""
    file = open_gguf(path)
    return _config(file.metadata, file.tensors, file.path)


def load_gguf(path: str, progress: bool = True) -> LoadedModel:
    """Load a Gemma 4 GGUF memory-mapped: config, weights (stored forms), metadata."""
    return load_gemma4(open_gguf(path), progress)


def load_gemma4(file: GGUFFile, progress: bool = True) -> LoadedModel:
    """The Gemma 4 model of an opened GGUF: config, weights (stored forms), metadata."""
    path, meta, tensors = file.path, file.metadata, file.tensors
    cfg = _config(meta, tensors, path)
    shapes = tensor_shapes(cfg)  # the expected torch-order shapes, by GGUF name
    if "output.weight" in tensors:
        log.warning("%s: output.weight present; Gemma 4 ties lm_head to token_embd, which is used", path)

    def need(name: str) -> Any:
        t = tensors.get(name)
        if t is None:
            raise GGUFError(f"{path}: missing tensor {name}")
        return t

    def q(name: str) -> QWeight:
        return _qweight(need(name), shapes[name], path)

    def v(name: str) -> torch.Tensor:
        return _vector(need(name), shapes[name], path)

    it: Any = range(cfg.num_layers)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"loading {os.path.basename(path)}", unit="layer")
    layers = []
    for i in it:
        p = f"blk.{i}."
        kind = cfg.layer_types[i]
        d = cfg.head_dim_swa if kind == "sliding" else cfg.head_dim_full
        kvh = cfg.num_kv_heads_swa if kind == "sliding" else cfg.num_kv_heads_full
        v_name = p + "attn_v.weight"
        if kind == "sliding" or not cfg.attention_k_eq_v_full:
            v_proj: QWeight | None = _qweight(need(v_name), (kvh * d, cfg.hidden_size), path)
        else:
            v_proj = None
        layers.append(LayerWeights(
            attn_norm=v(p + "attn_norm.weight"),
            q_proj=q(p + "attn_q.weight"),
            k_proj=q(p + "attn_k.weight"),
            v_proj=v_proj,
            o_proj=q(p + "attn_output.weight"),
            q_norm=v(p + "attn_q_norm.weight"),
            k_norm=v(p + "attn_k_norm.weight"),
            post_attention_norm=v(p + "post_attention_norm.weight"),
            ffn_norm=v(p + "ffn_norm.weight"),
            gate_proj=q(p + "ffn_gate.weight"),
            up_proj=q(p + "ffn_up.weight"),
            down_proj=q(p + "ffn_down.weight"),
            post_ffw_norm_1=v(p + "post_ffw_norm_1.weight"),
            router=v(p + "ffn_gate_inp.weight"),
            router_scale=v(p + "ffn_gate_inp.scale"),
            pre_ffw_norm_2=v(p + "pre_ffw_norm_2.weight"),
            experts=ExpertWeights(gate_up=_gate_up(tensors, i, cfg, path),
                                  down=q(p + "ffn_down_exps.weight")),
            per_expert_scale=v(p + "ffn_down_exps.scale"),
            post_ffw_norm_2=v(p + "post_ffw_norm_2.weight"),
            post_ffw_norm=v(p + "post_ffw_norm.weight"),
            layer_scalar=v(p + "layer_output_scale.weight"),
        ))
    weights = Gemma4Weights(embed=q("token_embd.weight"), final_norm=v("output_norm.weight"), layers=layers)
    return LoadedModel(cfg, weights, meta, path, os.path.getsize(path))


__all__ = ["GGUFError", "GGUFFile", "LoadedModel", "load_gemma4", "load_gguf", "open_gguf", "read_config",
           "read_metadata"]
