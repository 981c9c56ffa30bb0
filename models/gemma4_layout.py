"""The tensors of a Gemma 4 GGUF (llama.cpp `gemma4` names) and their shapes for a ModelConfig.

Beside the model definition (models/gemma4.py) but apart from it: the loader checks a file against
these shapes and the random-model generator (models/demo/tiny.py) writes them, and neither needs torch
or the model code for that. The order is the file order the generator writes (it seeds each
tensor's random stream by its index here), so changing it changes the generated demo model.
"""

from __future__ import annotations

from swaserve.engine.config import ModelConfig

ARCH = "gemma4"  # general.architecture, and the prefix of the architecture's metadata keys


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names -> torch-order shapes, in file order (fused ffn_gate_up_exps)."""
    hidden, experts = cfg.hidden_size, cfg.num_experts
    expert_inter, dense_inter = cfg.moe_intermediate_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.vocab_size, hidden),
        "rope_freqs.weight": (cfg.head_dim_full // 2,),
        "output_norm.weight": (hidden,),
    }
    for i, kind in enumerate(cfg.layer_types):
        sliding = kind == "sliding"
        head_dim = cfg.head_dim_swa if sliding else cfg.head_dim_full
        kv_heads = cfg.num_kv_heads_swa if sliding else cfg.num_kv_heads_full
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (hidden,)
        out[p + "attn_q.weight"] = (cfg.num_heads * head_dim, hidden)
        out[p + "attn_k.weight"] = (kv_heads * head_dim, hidden)
        if sliding or not cfg.attention_k_eq_v_full:
            out[p + "attn_v.weight"] = (kv_heads * head_dim, hidden)
        out[p + "attn_output.weight"] = (hidden, cfg.num_heads * head_dim)
        out[p + "attn_q_norm.weight"] = (head_dim,)
        out[p + "attn_k_norm.weight"] = (head_dim,)
        out[p + "post_attention_norm.weight"] = (hidden,)
        out[p + "ffn_norm.weight"] = (hidden,)
        out[p + "ffn_gate.weight"] = (dense_inter, hidden)
        out[p + "ffn_up.weight"] = (dense_inter, hidden)
        out[p + "ffn_down.weight"] = (hidden, dense_inter)
        out[p + "post_ffw_norm_1.weight"] = (hidden,)
        out[p + "ffn_gate_inp.weight"] = (experts, hidden)
        out[p + "ffn_gate_inp.scale"] = (hidden,)
        out[p + "pre_ffw_norm_2.weight"] = (hidden,)
        out[p + "ffn_gate_up_exps.weight"] = (experts, 2 * expert_inter, hidden)
        out[p + "ffn_down_exps.weight"] = (experts, hidden, expert_inter)
        out[p + "ffn_down_exps.scale"] = (experts,)
        out[p + "post_ffw_norm_2.weight"] = (hidden,)
        out[p + "post_ffw_norm.weight"] = (hidden,)
        out[p + "layer_output_scale.weight"] = (1,)
    return out
