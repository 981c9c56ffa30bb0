"""The Gemma 4 vision tower in plain torch: image patches -> soft tokens in the text model's space.

The computation follows transformers' Gemma4VisionModel + Gemma4MultimodalEmbedder (`get_image_features`):

1. Patch embedding: pixels in [0, 1] map to [-1, 1]; a bias-free linear over each 16x16x3 patch, plus a
   learned 2-D position embedding `table[0][x] + table[1][y]`.
2. `num_layers` encoder blocks, bidirectional over the image's patches: RMSNorm sandwich around attention
   and a gated GELU-tanh MLP. Attention: per-head RMSNorm on q and k (learned scale) and on v (no scale),
   2-D rotary embedding (first half of each head rotated by the x position, second half by y, each half
   in rotate-half order with `rope_theta` 100), score scale 1, grouped-query heads when num_kv_heads is
   smaller. Linears may carry Gemma4ClippableLinear input/output clamps (optional tensors).
3. Average pooling over `k x k` blocks of patches (k = pooling_kernel_size), scaled by sqrt(hidden_size).
4. Optional standardization `(h - std_bias) * std_scale`.
5. The multimodal embedder: scale-free RMSNorm, then a linear to the text hidden size.

Weights are keyed by their llama.cpp mmproj GGUF names (see models/mmproj.py for the names and where
each was verified); the patch embedding is stored as llama.cpp does, a conv kernel [D, 3, p, p].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_CLAMPS = ("input_min", "input_max", "output_min", "output_max")
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")
NORMS = ("ln1", "attn_post_norm", "ln2", "ffn_post_norm", "attn_q_norm", "attn_k_norm")


@dataclass(frozen=True)
class VisionConfig:
    """Shape and constants of a Gemma 4 vision tower (transformers' Gemma4VisionConfig fields renamed)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 16
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    standardize: bool = False
    text_hidden_size: int = 2304
    max_soft_tokens: int = 280
    # the text model's sliding layers let an image's soft tokens attend to each other (transformers:
    # text_config.use_bidirectional_attention == "vision"; llama.cpp: always for gemma4v)
    bidirectional_attention: bool = True

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 (2-D rotary embedding)")


def expected_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every required tensor's GGUF name and numpy shape (optional clamp scalars are not listed)."""
    D, F_, hd, p = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.patch_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (D, 3, p, p),
        "v.position_embd.weight": (2, cfg.position_embedding_size, D),
        "mm.input_projection.weight": (cfg.text_hidden_size, D),
    }
    if cfg.standardize:
        out["v.std_bias"] = (D,)
        out["v.std_scale"] = (D,)
    per_layer = {
        "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D), "attn_out": (D, q),
        "ffn_gate": (F_, D), "ffn_up": (F_, D), "ffn_down": (D, F_),
        "ln1": (D,), "attn_post_norm": (D,), "ln2": (D,), "ffn_post_norm": (D,),
        "attn_q_norm": (hd,), "attn_k_norm": (hd,),
    }
    for i in range(cfg.num_layers):
        for name, shape in per_layer.items():
            out[f"v.blk.{i}.{name}.weight"] = shape
    return out


def _rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm in fp32 (Gemma4RMSNorm: the weight multiplies directly, no `1 + w`), cast back."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight
    return y.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding over the last dim of x [..., N, H, d] with cos/sin [..., N, 1, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [..., N, H, d]
    return x * cos + rotated * sin


class Gemma4Vision:
    """The vision tower + multimodal embedder: one image (`encode`) or several of the same patch count in
    one forward (`encode_batch`)."""

    def __init__(
        self,
        cfg: VisionConfig,
        tensors: dict[str, torch.Tensor | np.ndarray],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        for name, shape in expected_shapes(cfg).items():
            if name not in tensors:
                raise ValueError(f"gemma4v vision weights: missing tensor {name}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"gemma4v vision weights: {name} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {shape}")

        def get(name: str, dt: torch.dtype) -> torch.Tensor:
            t = tensors[name]
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(np.array(t))  # a copy: the arrays may be read-only views
            return t.to(device=self.device, dtype=dt)

        D, p = cfg.hidden_size, cfg.patch_size
        # the conv kernel [D, 3, p, p] back to the linear over (row, column, channel) patch rows
        conv = get("v.patch_embd.weight", dtype)  # [D, 3, p, p]
        self.patch_w = conv.permute(0, 2, 3, 1).reshape(D, p * p * 3)  # [D, 3p^2]
        self.pos_table = get("v.position_embd.weight", dtype)  # [2, P, D]
        self.proj_w = get("mm.input_projection.weight", dtype)  # [T, D]
        self.std: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.standardize:
            self.std = (get("v.std_bias", torch.float32), get("v.std_scale", torch.float32))  # [D], [D]
        self.layers: list[dict[str, torch.Tensor]] = []
        self.clamps: list[dict[str, tuple[float, float, float, float]]] = []
        for i in range(cfg.num_layers):
            pre = f"v.blk.{i}."
            layer = {n: get(pre + n + ".weight", dtype) for n in LINEARS}
            layer.update({n: get(pre + n + ".weight", torch.float32) for n in NORMS})
            self.layers.append(layer)
            clamp: dict[str, tuple[float, float, float, float]] = {}
            for n in LINEARS:
                if any(f"{pre}{n}.{c}" in tensors for c in _CLAMPS):
                    lo_i, hi_i, lo_o, hi_o = (self._scalar(tensors, f"{pre}{n}.{c}", d) for c, d in
                                              zip(_CLAMPS, (-math.inf, math.inf, -math.inf, math.inf)))
                    clamp[n] = (lo_i, hi_i, lo_o, hi_o)
            self.clamps.append(clamp)
        hd = cfg.head_dim
        # one frequency set per axis, over a quarter of the head: arange(0, hd/2, 2) / (hd/2)
        exponents = torch.arange(0, hd // 2, 2, dtype=torch.float32) / (hd // 2)  # [hd/4]
        self.inv_freq = (1.0 / cfg.rope_theta**exponents).to(self.device)  # [hd/4]

    @staticmethod
    def _scalar(tensors: dict[str, torch.Tensor | np.ndarray], name: str, default: float) -> float:
        t = tensors.get(name)
        return default if t is None else float(np.asarray(t, dtype=np.float64).reshape(-1)[0])

    def _linear(self, x: torch.Tensor, layer: int, name: str) -> torch.Tensor:
        clamp = self.clamps[layer].get(name)
        if clamp is not None:
            x = x.clamp(clamp[0], clamp[1])
        y = x @ self.layers[layer][name].T
        return y if clamp is None else y.clamp(clamp[2], clamp[3])

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [..., N, 1, hd] for positions [..., N, 2]: x angles on the first half, y on the second."""
        ang = positions.float()[..., None] * self.inv_freq  # [..., N, 2, hd/4]
        ang = torch.cat([ang, ang], dim=-1)  # [..., N, 2, hd/2]: each axis's rotate-half pair
        ang = ang.reshape(*ang.shape[:-2], 1, -1)  # [..., N, 1, hd]
        return ang.cos().to(self.dtype), ang.sin().to(self.dtype)

    def _attention(self, h: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, L = self.cfg, self.layers[i]
        B, N, hd, half = h.shape[0], h.shape[1], cfg.head_dim, cfg.head_dim // 2
        q = self._linear(h, i, "attn_q").view(B, N, cfg.num_heads, hd)  # [B, N, H, hd]
        k = self._linear(h, i, "attn_k").view(B, N, cfg.num_kv_heads, hd)  # [B, N, KV, hd]
        v = self._linear(h, i, "attn_v").view(B, N, cfg.num_kv_heads, hd)  # [B, N, KV, hd]
        q = _rms(q, cfg.rms_norm_eps, L["attn_q_norm"])
        k = _rms(k, cfg.rms_norm_eps, L["attn_k_norm"])
        v = _rms(v, cfg.rms_norm_eps)
        q = torch.cat([_rotate(q[..., :half], cos[..., :half], sin[..., :half]),
                       _rotate(q[..., half:], cos[..., half:], sin[..., half:])], dim=-1)  # [B, N, H, hd]
        k = torch.cat([_rotate(k[..., :half], cos[..., :half], sin[..., :half]),
                       _rotate(k[..., half:], cos[..., half:], sin[..., half:])], dim=-1)  # [B, N, KV, hd]
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)  # [B, N, H, hd]
            v = v.repeat_interleave(rep, dim=2)  # [B, N, H, hd]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0
        )  # [B, H, N, hd]: each image attends to its own patches only
        return self._linear(out.transpose(1, 2).reshape(B, N, cfg.num_heads * hd), i, "attn_out")  # [B, N, D]

    def _pool(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Average k x k blocks of patches by their positions, in row-major block order: [S, D] fp32."""
        k = self.cfg.pooling_kernel_size
        cells_x = (int(positions[:, 0].max()) + 1) // k
        cell = positions[:, 0] // k + cells_x * (positions[:, 1] // k)  # [N]
        n_cells = h.shape[0] // (k * k)
        out = torch.zeros(n_cells, h.shape[1], dtype=torch.float32, device=h.device)  # [S, D]
        out.index_add_(0, cell, h.float())
        return out / (k * k)

    def _patches(self, pixel_values: torch.Tensor, position_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's patches, checked, padding dropped, on the device: ([N, 3 p^2] in [-1, 1], [N, 2])."""
        cfg = self.cfg
        pixel_values = torch.as_tensor(pixel_values)
        position_ids = torch.as_tensor(position_ids)
        if pixel_values.dim() == 3:  # a batch of one, as the HF processor returns it
            pixel_values, position_ids = pixel_values[0], position_ids[0]
        keep = (position_ids != -1).any(dim=-1)  # [N]: drop the processor's padding, if any
        pixel_values, position_ids = pixel_values[keep], position_ids[keep]
        N = pixel_values.shape[0]
        if pixel_values.shape[-1] != 3 * cfg.patch_size**2 or N % cfg.pooling_kernel_size**2:
            raise ValueError(f"bad patches {tuple(pixel_values.shape)} for patch {cfg.patch_size}, "
                             f"pooling {cfg.pooling_kernel_size}")
        pos = position_ids.to(device=self.device, dtype=torch.long)  # [N, 2]
        if N and (int(pos.min()) < 0 or int(pos.max()) >= cfg.position_embedding_size):
            raise ValueError(f"patch positions {int(pos.min())}..{int(pos.max())} outside the position table "
                             f"(size {cfg.position_embedding_size})")
        return pixel_values.to(device=self.device, dtype=self.dtype) * 2 - 1, pos

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One image's patches [N, 3 p^2] (values in [0, 1]) and (x, y) positions [N, 2] -> fp32 soft
        tokens [N / k^2, text_hidden_size].

        These are exactly the rows transformers scatters into `inputs_embeds` at the image placeholder
        positions (`Gemma4Model.get_image_features(...).pooler_output`). The text embedding scale
        sqrt(text hidden size) is NOT part of them and must not be applied to them: transformers scales
        only the text tokens' embedding lookups. Padding patches (position (-1, -1)) are ignored."""
        return self.encode_batch([(pixel_values, position_ids)])[0]

    @torch.no_grad()
    def encode_batch(self, images: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Several images of the same patch count (after padding is dropped) in one forward: `encode` of
        each, in order. Attention stays within each image."""
        cfg = self.cfg
        prepared = [self._patches(pv, pos) for pv, pos in images]
        if len({x.shape[0] for x, _ in prepared}) > 1:
            raise ValueError(f"encode_batch needs one patch count, got {[x.shape[0] for x, _ in prepared]}")
        x = torch.stack([p[0] for p in prepared])  # [B, N, 3p^2] in [-1, 1]
        pos = torch.stack([p[1] for p in prepared])  # [B, N, 2]
        h = x @ self.patch_w.T + self.pos_table[0][pos[..., 0]] + self.pos_table[1][pos[..., 1]]  # [B, N, D]
        cos, sin = self._rope_tables(pos)  # [B, N, 1, hd]
        eps = cfg.rms_norm_eps
        for i, L in enumerate(self.layers):
            a = self._attention(_rms(h, eps, L["ln1"]), i, cos, sin)  # [B, N, D]
            h = h + _rms(a, eps, L["attn_post_norm"])
            m = _rms(h, eps, L["ln2"])  # [B, N, D]
            g = F.gelu(self._linear(m, i, "ffn_gate"), approximate="tanh") * self._linear(m, i, "ffn_up")
            h = h + _rms(self._linear(g, i, "ffn_down"), eps, L["ffn_post_norm"])  # [B, N, D]
        out = []
        for b in range(h.shape[0]):
            s = self._pool(h[b], pos[b]) * math.sqrt(cfg.hidden_size)  # [S, D] fp32
            if self.std is not None:
                s = (s - self.std[0]) * self.std[1]  # [S, D]
            s = _rms(s.to(self.dtype), eps)  # [S, D]
            out.append((s @ self.proj_w.T).float())  # [S, T]
        return out
