"""tools/gpu_check/run.py's model-level checks: end-to-end decode of the fused model (random weights)."""

from __future__ import annotations

import time
from typing import Any

from tools.gpu_check.base import Ctx, Row, rel_err
from tools.gpu_check.kernels import rand_q4

# ---- end to end ---------------------------------------------------------------------------------


def check_e2e(c: Ctx, S, B: int) -> list[Row]:
    torch = c.torch
    from swaserve.engine.attention.base import AttentionMetadata
    from swaserve.engine.attention.kv_pool import KVPool
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend
    from swaserve.engine.moe.triton_backend import TritonMoE
    from swaserve.models.gemma4 import Gemma4Model

    cfg = _e2e_config(S)
    weights = _random_weights(c, cfg)
    model = Gemma4Model(
        cfg,
        weights,
        TritonAttentionBackend(),
        TritonMoE(cfg, weights.experts, c.dev),
        c.dev,
        dtype=torch.bfloat16,
    )
    P, L0, steps = S.page_size, S.e2e_prompt, S.e2e_steps
    per_seq = -(-(L0 + steps + 1) // P)
    pool = KVPool(cfg, B * per_seq, B * per_seq, P, torch.bfloat16, c.dev)
    pt = torch.arange(B * per_seq).view(B, per_seq)  # sequence b owns pages [b * per_seq, ...)

    def meta_for(q_lens: list[int], prefix: list[int]) -> AttentionMetadata:
        pos = torch.cat([torch.arange(p, p + q) for p, q in zip(prefix, q_lens)])
        bof = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
        slots = pt[bof, pos // P] * P + pos % P
        return AttentionMetadata(P, cfg.sliding_window, q_lens, prefix, pos, slots, slots, pt, pt).to(c.dev)

    ids = torch.randint(0, cfg.vocab_size, (B * L0,), device=c.dev, generator=c.gen)
    h = model.forward(ids, meta_for([L0] * B, [0] * B), pool)
    nxt = model.logits(h[torch.arange(1, B + 1, device=c.dev) * L0 - 1]).argmax(-1)  # [B]
    if c.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        h = model.forward(nxt, meta_for([1] * B, [L0 + s] * B), pool)
        nxt = model.logits(h).argmax(-1)
    if c.cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    finite = bool(torch.isfinite(h).all())
    err = _e2e_vs_torch(c, S, cfg, weights, ids[: min(64, L0)])
    return [
        Row(
            f"e2e decode B={B}",
            f"{S.preset} ctx {L0}",
            "ok" if finite and err <= (0.1 if c.cuda else 1e-3) else "FAIL",
            err,
            dt / steps * 1e3,
            None,
            f"{B * steps / dt:.1f} tok/s",
            "ms = per decode step; random Q4_0; err = last-token logits vs torch backends"
            + ("" if c.cuda else " (fp32)"),
        )
    ]


def _e2e_vs_torch(c: Ctx, S, cfg, weights, ids) -> float:
    """Relative max error of a prompt's last-token logits: triton backends vs torch backends.

    On CPU (the interpreter smoke) both models run in fp32: in bf16 a near-tie in the random
    router flips an expert choice between the two backends' roundings for about one seed in
    thirty, and one flipped expert moves the logits past any tolerance that still catches a bug.
    """
    torch = c.torch
    from swaserve.engine.attention.base import AttentionMetadata
    from swaserve.engine.attention.kv_pool import KVPool
    from swaserve.engine.attention.torch_backend import TorchAttentionBackend
    from swaserve.engine.attention.triton_backend import TritonAttentionBackend
    from swaserve.engine.moe.torch_backend import TorchMoE
    from swaserve.engine.moe.triton_backend import TritonMoE
    from swaserve.models.gemma4 import Gemma4Model

    dt = torch.bfloat16 if c.cuda else torch.float32
    model = Gemma4Model(cfg, weights, TritonAttentionBackend(), TritonMoE(cfg, weights.experts, c.dev), c.dev,
                        dtype=dt)
    ref = Gemma4Model(cfg, weights, TorchAttentionBackend(), TorchMoE(cfg, weights.experts, c.dev), c.dev,
                      dtype=dt)
    n, P = ids.numel(), S.page_size
    pages = -(-n // P)
    pt = torch.arange(pages).view(1, pages)
    pos = torch.arange(n)
    slots = pt[0, pos // P] * P + pos % P
    meta = AttentionMetadata(P, cfg.sliding_window, [n], [0], pos, slots, slots, pt, pt).to(c.dev)

    def last_logits(m) -> Any:
        pool = KVPool(cfg, pages, pages, P, dt, c.dev)
        return m.logits(m.forward(ids, meta, pool)[-1:])

    return rel_err(last_logits(model), last_logits(ref))


def _e2e_config(S):
    try:
        from swaserve.models.demo.tiny import preset_config

        return preset_config(S.preset, vocab_size=None if S.preset != "tiny" else 256)
    except ImportError:  # models.tiny needs gguf; the shapes are the same either way
        from swaserve.engine.config import ModelConfig

        return ModelConfig(
            vocab_size=262144,
            hidden_size=2816,
            num_layers=30,
            num_heads=16,
            layer_types=(("sliding",) * 5 + ("full",)) * 5,
            head_dim_swa=256,
            head_dim_full=512,
            num_kv_heads_swa=8,
            num_kv_heads_full=2,
            sliding_window=1024,
            intermediate_size=2112,
            moe_intermediate_size=704,
            num_experts=128,
            top_k_experts=8,
        )


def _random_weights(c: Ctx, cfg):
    """Random Gemma 4 weights in stored form, generated on the device (no GGUF)."""
    torch = c.torch
    from swaserve.engine.moe.base import ExpertWeights
    from swaserve.models.weights import Gemma4Weights, LayerWeights

    H = cfg.hidden_size

    def vec(n: int, base: float = 1.0):
        return base * (0.8 + 0.4 * torch.rand(n, device=c.dev, generator=c.gen))

    layers = []
    for kind in cfg.layer_types:
        D = cfg.head_dim_swa if kind == "sliding" else cfg.head_dim_full
        kvh = cfg.num_kv_heads_swa if kind == "sliding" else cfg.num_kv_heads_full
        E, Ie, Id = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
        layers.append(
            LayerWeights(
                attn_norm=vec(H),
                q_proj=rand_q4(c, (cfg.num_heads * D, H)),
                k_proj=rand_q4(c, (kvh * D, H)),
                v_proj=rand_q4(c, (kvh * D, H)) if kind == "sliding" else None,
                o_proj=rand_q4(c, (H, cfg.num_heads * D)),
                q_norm=vec(D, D**-0.25),
                k_norm=vec(D, D**-0.25),
                post_attention_norm=vec(H),
                ffn_norm=vec(H),
                gate_proj=rand_q4(c, (Id, H)),
                up_proj=rand_q4(c, (Id, H)),
                down_proj=rand_q4(c, (H, Id)),
                post_ffw_norm_1=vec(H),
                router=torch.randn(E, H, device=c.dev, generator=c.gen),
                router_scale=vec(H),
                pre_ffw_norm_2=vec(H),
                experts=ExpertWeights(gate_up=rand_q4(c, (E, 2 * Ie, H)), down=rand_q4(c, (E, H, Ie))),
                per_expert_scale=vec(E),
                post_ffw_norm_2=vec(H),
                post_ffw_norm=vec(H),
                layer_scalar=torch.ones(1, device=c.dev),
            )
        )
    return Gemma4Weights(embed=rand_q4(c, (cfg.vocab_size, H)), final_norm=vec(H), layers=layers)
