"""Parity with transformers for every stored GGUF type and llama.cpp mix: a random Gemma 4 written as
random blocks of the type (models/demo/random_blocks.py), loaded by our loader and run in its stored form,
against transformers given the weights the *file* defines (decoded by gguf's numpy code from the
file's bytes, not from our loader). Forced sequence of 121 tokens: the chosen token's log-probability
at each of the 120 positions, and the argmax.

Geometry: hidden 256 so every matrix is whole 256-weight super-blocks (a one-type file uses its type in
every role: attention, dense MLP, experts, the token embedding and tied lm_head).
`pytest tests/models/test_type_parity.py -s` prints the table of docs/model.md.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.config import ModelConfig
from swaserve.engine.moe import get_moe_backend
from swaserve.engine.quant.base import QWeight
from swaserve.engine.quant.dequant import dequantize
from swaserve.models.demo.quant_mix import BLOCK_QTYPES, tensor_types
from swaserve.models.demo.tiny import LazyTensors, write_gguf
from swaserve.models.gemma4 import Gemma4Model
from swaserve.models.gemma4_layout import tensor_shapes
from swaserve.models.gguf_loader import load_gguf
from tests.models.hf_oracle import PagedRunner, build_hf_model, file_weights_into_hf, hf_config_for, hf_logits

PARITY = ModelConfig(
    vocab_size=512, hidden_size=256, num_layers=6, num_heads=4, layer_types=("sliding",) * 5 + ("full",),
    head_dim_swa=64, head_dim_full=128, num_kv_heads_swa=2, num_kv_heads_full=1, sliding_window=16,
    intermediate_size=256, moe_intermediate_size=256, num_experts=8, top_k_experts=2, rope_dims_swa=64,
    rope_dims_full=128, rope_full_rotated_pairs=16, context_length=4096,
)
TOKENIZER_META = {"tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
POSITIONS = 120
# (label, --qtype, --embed-qtype)
CASES = [(q, q, None) for q in BLOCK_QTYPES] + [
    ("Q4_K_M", "Q4_K_M", None), ("Q5_K_M", "Q5_K_M", None), ("Q4_0 + Q6_K embedding", "Q4_0", "Q6_K"),
    ("F16", "F16", None),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small matmuls: on a busy 2-core machine, 2 OpenMP threads are many times slower than 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def forced_sequence(seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2] + rng.integers(3, PARITY.vocab_size, size=POSITIONS).tolist()


def chosen_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """log p(ids[t + 1] | ids[: t + 1]) for t < len(ids) - 1, in float64."""
    lp = torch.log_softmax(logits.double(), dim=-1)[:-1]
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def write(path: str, qtype: str, embed_qtype: str | None) -> dict[str, str]:
    types = tensor_types(tensor_shapes(PARITY), qtype, embed_qtype)
    write_gguf(path, PARITY, LazyTensors(PARITY, 0, types, raw=True), TOKENIZER_META, qtype=qtype,
               embed_qtype=embed_qtype)
    return types


def compare(path: str, ids: list[int], embed: QWeight | None = None) -> tuple[float, float, int]:
    """(median, max |dlogprob|, argmax agreements) of our model on `path` vs transformers on the file."""
    loaded = load_gguf(path, progress=False)
    weights = loaded.weights
    if embed is not None:
        weights.embed = embed
    moe = get_moe_backend("torch", PARITY, weights.experts, "cpu")
    model = Gemma4Model(PARITY, weights, TorchAttentionBackend(), moe, "cpu")
    ours = PagedRunner(model, PARITY, 16, len(ids) + 16, 1).step([(0, ids)])[0]
    hf = build_hf_model(hf_config_for(PARITY), seed=0)
    file_weights_into_hf(hf, path)
    ref = hf_logits(hf, ids)
    d = (chosen_logprobs(ours, ids) - chosen_logprobs(ref, ids)).abs()
    agree = int((ours.argmax(-1) == ref.argmax(-1))[:-1].sum())
    return d.median().item(), d.max().item(), agree


@pytest.mark.parametrize("label,qtype,embed_qtype", CASES, ids=[c[0] for c in CASES])
def test_forced_sequence_matches_transformers(tmp_path, label: str, qtype: str,
                                              embed_qtype: str | None) -> None:
    path = str(tmp_path / "m.gguf")
    types = write(path, qtype, embed_qtype)
    loaded = load_gguf(path, progress=False)  # every matrix in the type the file stores, as stored
    lw = loaded.weights.layers[0]
    for w in (loaded.weights.embed, lw.q_proj, lw.v_proj, lw.down_proj, lw.experts.gate_up, lw.experts.down):
        assert w.qtype == types[w.name], (w.name, w.qtype)
        assert w.mmapped or w.qtype == "F32"
    med, mx, agree = compare(path, forced_sequence())
    stored = sorted({t for t in types.values() if t != "F32"})
    print(f"\nparity row | {label} | {', '.join(stored)} | {med:.1e} | {mx:.1e} | {agree}/{POSITIONS} |")
    assert med < 5e-5 and mx < 1e-3, (med, mx)
    assert agree == POSITIONS


def test_an_f16_copy_of_the_embedding_is_caught(tmp_path) -> None:
    """The root cause of issue 12: the loader used to turn a Q6_K token embedding into an F16 copy, so
    the model ran weights the file does not define (each rounded to 11 bits; the lookup feeds the
    error into every layer). Against the file's own weights, that copy is off by about 1e-2 median."""
    path = str(tmp_path / "m.gguf")
    write(path, "Q4_0", "Q6_K")
    loaded = load_gguf(path, progress=False)
    assert loaded.weights.embed.qtype == "Q6_K"
    embed = loaded.weights.embed
    f16 = QWeight("F16", embed.shape, dequantize(embed).half(), embed.name)
    med, mx, agree = compare(path, forced_sequence(), embed=f16)
    print(f"\nparity row | Q4_0 + Q6_K embedding held as an F16 copy (the old loader) | Q4_0, F16 "
          f"| {med:.1e} | {mx:.1e} | {agree}/{POSITIONS} |")
    assert med > 1e-4 and mx > 1e-2  # the oracle sees the change; the stored form is exact (above)
