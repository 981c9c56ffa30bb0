"""The Gemma 4 weights as the loader hands them to the model (torch naming, GGUF stored forms)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.engine.moe.base import ExpertWeights
from swaserve.engine.quant.base import QWeight


@dataclass
class LayerWeights:
    # GGUF name in comments (blk.N. prefix)
    attn_norm: torch.Tensor  # attn_norm [H] f32
    q_proj: QWeight  # attn_q [heads * D, H]
    k_proj: QWeight  # attn_k [kvh * D, H]
    v_proj: QWeight | None  # attn_v (sliding layers only; None where K = V)
    o_proj: QWeight  # attn_output [H, heads * D]
    q_norm: torch.Tensor  # attn_q_norm [D]
    k_norm: torch.Tensor  # attn_k_norm [D]
    post_attention_norm: torch.Tensor  # post_attention_norm [H]
    ffn_norm: torch.Tensor  # ffn_norm (pre_feedforward_layernorm) [H]
    gate_proj: QWeight  # ffn_gate [I, H]
    up_proj: QWeight  # ffn_up [I, H]
    down_proj: QWeight  # ffn_down [H, I]
    post_ffw_norm_1: torch.Tensor  # [H]
    router: torch.Tensor  # ffn_gate_inp.weight [E, H] f32
    router_scale: torch.Tensor  # ffn_gate_inp.scale [H] f32
    pre_ffw_norm_2: torch.Tensor  # [H]
    # routed experts, as the MoE backend reads them: gate_up = ffn_gate_up_exps [E, 2 * I_e, H] (gate
    # rows first; fused at load from ffn_gate_exps + ffn_up_exps), down = ffn_down_exps [E, H, I_e]
    experts: ExpertWeights
    per_expert_scale: torch.Tensor  # ffn_down_exps.scale [E] f32
    post_ffw_norm_2: torch.Tensor  # [H]
    post_ffw_norm: torch.Tensor  # [H]
    layer_scalar: torch.Tensor  # layer_output_scale.weight [1] f32


@dataclass
class Gemma4Weights:
    embed: QWeight  # token_embd [V, H] (also the tied lm_head)
    final_norm: torch.Tensor  # output_norm [H]
    layers: list[LayerWeights]

    @property
    def experts(self) -> list[ExpertWeights]:
        """The routed experts of every layer, in layer order (what the MoE backends take)."""
        return [layer.experts for layer in self.layers]
