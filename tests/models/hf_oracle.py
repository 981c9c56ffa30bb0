"""Test helpers: a tiny random transformers Gemma 4 (the oracle), its GGUF tensors, and a paged runner
that drives our model through the KV pools like the engine does (identity page tables)."""

from __future__ import annotations

import math
from operator import attrgetter

import numpy as np
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.config import ModelConfig
from swaserve.engine.core import Batch, Req, SamplingParams
from swaserve.engine.quant.dequant import dequantize
from swaserve.engine.runner.model_runner import key_ends
from swaserve.models.weights import Gemma4Weights

LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def tiny_hf_config(window: int = 16, vocab: int = 300) -> Gemma4TextConfig:
    """Every 26B-A4B feature at toy size: 5 sliding + 1 full, K = V, proportional rope, MoE."""
    cfg = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, sliding_window=window, final_logit_softcapping=30.0,
        layer_types=list(LAYER_TYPES), rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        initializer_range=0.08, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_config_for(cfg: ModelConfig) -> Gemma4TextConfig:
    """The transformers config of our ModelConfig (the inverse of `model_config`)."""
    hcfg = Gemma4TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads_swa, head_dim=cfg.head_dim_swa,
        global_head_dim=cfg.head_dim_full,
        num_global_key_value_heads=cfg.num_kv_heads_full, attention_k_eq_v=cfg.attention_k_eq_v_full,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=cfg.num_experts,
        top_k_experts=cfg.top_k_experts, moe_intermediate_size=cfg.moe_intermediate_size,
        sliding_window=cfg.sliding_window, final_logit_softcapping=cfg.final_logit_softcap,
        layer_types=[f"{t}_attention" for t in cfg.layer_types], rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.context_length,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta_swa},
            "full_attention": {"rope_type": "proportional", "rope_theta": cfg.rope_theta_full,
                               "partial_rotary_factor": 2 * cfg.rope_full_rotated_pairs / cfg.head_dim_full},
        },
        pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_ids[0], bos_token_id=cfg.bos_token_id,
    )
    hcfg._attn_implementation = "eager"
    return hcfg


def build_hf_model(cfg: Gemma4TextConfig, seed: int = 0) -> Gemma4ForCausalLM:
    """Random fp32 model with norm weights, router scales, per-expert scales and layer scalars
    randomised (their constant initial values would hide mapping bugs)."""
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "layernorm.weight", "norm_1.weight", "norm_2.weight",
                              "router.scale", "per_expert_scale", "layer_scalar")):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
    return model


def full_head_dim(cfg: Gemma4TextConfig) -> int:
    return cfg.per_layer_config["full_attention"].head_dim


def rotated_pairs(cfg: Gemma4TextConfig) -> int:
    rp = cfg.rope_parameters["full_attention"]
    return int(rp["partial_rotary_factor"] * full_head_dim(cfg) // 2)


def model_config(cfg: Gemma4TextConfig) -> ModelConfig:
    """Our ModelConfig for a transformers Gemma4TextConfig."""
    full_dim = full_head_dim(cfg)
    swa, full = cfg.per_layer_config["sliding_attention"], cfg.per_layer_config["full_attention"]
    return ModelConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in cfg.layer_types),
        head_dim_swa=swa.head_dim, head_dim_full=full_dim,
        num_kv_heads_swa=swa.num_key_value_heads, num_kv_heads_full=full.num_key_value_heads,
        sliding_window=cfg.sliding_window, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts,
        top_k_experts=cfg.top_k_experts, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta_swa=cfg.rope_parameters["sliding_attention"]["rope_theta"],
        rope_theta_full=cfg.rope_parameters["full_attention"]["rope_theta"],
        rope_dims_swa=swa.head_dim, rope_dims_full=full_dim, rope_full_rotated_pairs=rotated_pairs(cfg),
        final_logit_softcap=cfg.final_logit_softcapping, context_length=cfg.max_position_embeddings,
    )


# HF module suffix -> GGUF name suffix (llama.cpp's gemma4 mapping; norms stored raw, no +1/-1)
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
}


def gguf_tensors(model: Gemma4ForCausalLM) -> dict[str, np.ndarray]:
    """GGUF-named fp32 arrays (torch-order shapes) of an HF model, as models.tiny.write_gguf takes them."""
    sd = dict(model.state_dict()) | {n: b for n, b in model.named_buffers() if n.endswith("layer_scalar")}
    out: dict[str, np.ndarray] = {}
    for name, t in sd.items():
        a = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name.startswith("model.layers."):
            idx, rest = name[len("model.layers."):].split(".", 1)
            if rest in _LAYER_MAP:
                out[f"blk.{idx}.{_LAYER_MAP[rest]}"] = a.reshape(-1) if rest == "layer_scalar" else a
    cfg = model.config
    pairs, half = rotated_pairs(cfg), full_head_dim(cfg) // 2
    out["rope_freqs.weight"] = np.array([1.0] * pairs + [1e30] * (half - pairs), dtype=np.float32)
    return out


# LayerWeights field (dotted: attrgetter path) -> GGUF name (blk.N. prefix); the loader must map each
# one to its own tensor
LAYER_FIELDS = {
    "attn_norm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight", "o_proj": "attn_output.weight", "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight", "post_attention_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight", "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight", "post_ffw_norm_1": "post_ffw_norm_1.weight",
    "router": "ffn_gate_inp.weight", "router_scale": "ffn_gate_inp.scale",
    "pre_ffw_norm_2": "pre_ffw_norm_2.weight", "experts.gate_up": "ffn_gate_up_exps.weight",
    "experts.down": "ffn_down_exps.weight", "per_expert_scale": "ffn_down_exps.scale",
    "post_ffw_norm_2": "post_ffw_norm_2.weight", "post_ffw_norm": "post_ffw_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
}


def load_weights_into_hf(model: Gemma4ForCausalLM, w: Gemma4Weights) -> None:
    """Overwrite the HF model's parameters with our (dequantized) weights, for Q4_0 parity."""
    inv = {v: k for k, v in _LAYER_MAP.items()}
    params = dict(model.named_parameters()) | dict(model.named_buffers())

    def put(hf_name: str, value: torch.Tensor) -> None:
        t = params[hf_name]
        t.data.copy_(value.reshape(t.shape).float())

    with torch.no_grad():
        put("model.embed_tokens.weight", dequantize(w.embed))
        put("model.norm.weight", w.final_norm)
        for i, lw in enumerate(w.layers):
            for field, gname in LAYER_FIELDS.items():
                val = attrgetter(field)(lw)
                if val is None:
                    continue
                put(f"model.layers.{i}.{inv[gname]}", dequantize(val) if hasattr(val, "qtype") else val)
    model.tie_weights()


def iq1_m_reference(raw: np.ndarray) -> np.ndarray:
    """IQ1_M blocks uint8 [..., 56 k] -> fp32 weights, following llama.cpp's dequantize_row_iq1_m (gguf-py
    0.19 gets the offset signs wrong: `qh & 0x08 == 0` parses as `qh & False`)."""
    from gguf import quants

    quants.IQ1_M.init_grid()
    grid = quants.IQ1_M.grid.reshape(2048, 8)
    b = raw.reshape(-1, 56)
    sc = b[:, 48:56].copy().view(np.uint16).astype(np.uint32)  # [n, 4]
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = d_bits.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]  # [n, 1]
    scales = np.stack([(sc >> (3 * t)) & 7 for t in range(4)], axis=2).reshape(-1, 16)  # per 16 weights
    dl = d * (2 * scales + 1).astype(np.float32)  # [n, 16]
    nib = np.stack([b[:, 32:48] & 0xF, b[:, 32:48] >> 4], axis=2).reshape(-1, 32)  # per 8 weights
    idx = b[:, 0:32].astype(np.int64) | ((nib & 7).astype(np.int64) << 8)
    delta = np.where(nib & 8, np.float32(-0.125), np.float32(0.125))  # [n, 32]
    w = dl.reshape(-1, 16, 1, 1) * (grid[idx].reshape(-1, 16, 2, 8) + delta.reshape(-1, 16, 2, 1))
    return w.reshape(*raw.shape[:-1], raw.shape[-1] // 56 * 256).astype(np.float32)


def file_weights_into_hf(model: Gemma4ForCausalLM, path: str) -> None:
    """Overwrite the HF model's parameters with the weights a GGUF file defines, decoded by gguf's own
    numpy code from the file's bytes: an oracle independent of our loader (a loader that changed a
    weight while loading, e.g. rounded it to F16, shows up as a parity error)."""
    from gguf import GGUFReader, quants

    inv = {v: k for k, v in _LAYER_MAP.items()}
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for t in GGUFReader(path).tensors:
            if t.name == "rope_freqs.weight":
                continue
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if t.tensor_type.name == "IQ1_M":
                vals = iq1_m_reference(np.asarray(t.data)).reshape(shape)
            else:
                vals = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
            if t.name == "token_embd.weight":
                hf_name = "model.embed_tokens.weight"
            elif t.name == "output_norm.weight":
                hf_name = "model.norm.weight"
            else:
                _, idx, rest = t.name.split(".", 2)
                hf_name = f"model.layers.{idx}.{inv[rest]}"
            target = params[hf_name]
            target.data.copy_(torch.from_numpy(vals.copy()).reshape(target.shape))
    model.tie_weights()


@torch.no_grad()
def hf_logits(model: Gemma4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """Full-recompute logits [len(ids), V] (fp32, softcapped) from the oracle."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


class PagedRunner:
    """Drives a Gemma4Model through a KVPool like the engine: sequence s owns the identity pages
    [s * pps, (s + 1) * pps) of both pools; SWA pages wholly before the window are -1 in the table."""

    def __init__(self, model, cfg: ModelConfig, page_size: int, max_len: int, max_seqs: int = 4,
                 kv_dtype: torch.dtype = torch.float32):
        self.model, self.cfg, self.P = model, cfg, page_size
        self.pps = math.ceil(max_len / page_size)  # pages per sequence
        n = self.pps * max_seqs
        self.pool = KVPool(cfg, n, n, page_size, kv_dtype, torch.device("cpu"))
        self.lens: dict[int, int] = {}

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Sequence dst starts with src's first `length` positions' KV (copied, every layer): a prefix hit."""
        base = self.pps * self.P
        for layer in range(self.cfg.num_layers):
            for t in self.pool.kv(layer):
                t[dst * base:dst * base + length] = t[src * base:src * base + length]
        self.lens[dst] = length

    def step(self, chunks: list[tuple[int, list[int]]],
             images: tuple[torch.Tensor, torch.Tensor] | None = None,
             attn_blocks: dict[int, tuple[tuple[int, int], ...]] | None = None) -> list[torch.Tensor]:
        """Run new tokens of several sequences in one batch -> fp32 logits [n_i, V] per chunk; `images`:
        (flat row index, rows) of image soft tokens, as Gemma4Model.forward takes them; `attn_blocks`:
        sequence -> its bidirectional image spans (Req.attn_blocks; the engine's key_ends from them)."""
        P, W = self.P, self.cfg.sliding_window
        ids, pos, slots, prefixes, qlens = [], [], [], [], []
        full_pt = torch.full((len(chunks), self.pps), -1, dtype=torch.int64)
        swa_pt = torch.full((len(chunks), self.pps), -1, dtype=torch.int64)
        for b, (s, toks) in enumerate(chunks):
            p = self.lens.get(s, 0)
            end = p + len(toks)
            assert end <= self.pps * P, "sequence longer than the runner's max_len"
            base = s * self.pps
            npg = math.ceil(end / P)
            full_pt[b, :npg] = torch.arange(base, base + npg)
            first = max(0, p - W + 1) // P
            swa_pt[b, first:npg] = torch.arange(base + first, base + npg)
            ids += toks
            pos.append(torch.arange(p, end))
            slots.append(base * P + torch.arange(p, end))
            prefixes.append(p)
            qlens.append(len(toks))
            self.lens[s] = end
        positions = torch.cat(pos)
        slot_t = torch.cat(slots)
        ends = None
        if attn_blocks:
            reqs = [Req(str(s), str(s), 0, [0] * (p + n), p + n, SamplingParams(),
                        attn_blocks=attn_blocks.get(s, ())) for (s, _), p, n in zip(chunks, prefixes, qlens)]
            ends = key_ends(Batch(reqs, qlens, prefixes, [True] * len(reqs)))
        meta = AttentionMetadata(P, W, qlens, prefixes, positions, slot_t, slot_t.clone(), full_pt, swa_pt,
                                 key_ends=ends)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64), meta, self.pool, images=images)
        logits = self.model.logits(hidden)
        return list(torch.split(logits, qlens))
