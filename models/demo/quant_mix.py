"""Which stored type each Gemma 4 tensor gets: a single type everywhere, or one of llama.cpp's
quantization mixes (the rules of llama-quantize's `llama_tensor_get_type`, restated for gemma4).

Facts taken from llama.cpp (src/llama-quant.cpp), for an architecture with a tied token embedding,
no `output.weight` and more than 8 experts (gemma-4-26B-A4B: 128):
- the token embedding is quantized like the output tensor: Q8_0 in a Q8_0 file, else Q6_K (Q8_0 when
  the row length is not a multiple of the default type's block);
- Q4_K_M / Q5_K_M give `attn_v` Q6_K on "more bits" layers (counted over the attn_v tensors in layer
  order) and `ffn_down` (dense and experts, counted by layer) Q6_K on "more bits" layers, the rest
  the mix's base type (Q4_K / Q5_K); every other matrix gets the base type;
- a row length that is not a multiple of the chosen type's block falls back: Q2_K/Q3_K -> Q4_0,
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, and to F16 when even 32 does not divide
  it (the IQ1/IQ2/IQ3 types -> IQ4_NL). On gemma-4-26B-A4B this hits `ffn_down` (2112 columns) and
  `ffn_down_exps` (704 columns).
Norms, the router, scales and `rope_freqs` stay F32 (llama.cpp quantizes only 2-D/3-D `.weight`
tensors other than norms and `ffn_gate_inp`).
"""

from __future__ import annotations

from collections.abc import Mapping

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

FLOAT_QTYPES = ("F32", "F16", "BF16")
BLOCK_QTYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
)
# llama.cpp mixes beyond "one type everywhere" (Q6_K and Q8_0 files are one type plus the fallbacks)
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
QTYPE_CHOICES = (*BLOCK_QTYPES, *MIXES, *FLOAT_QTYPES)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
            "IQ4_XS": "IQ4_NL", **{q: "IQ4_NL" for q in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                                                         "IQ1_S", "IQ1_M")}}
FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_S, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL, "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
    "IQ2_XXS": LlamaFileType.MOSTLY_IQ2_XXS, "IQ2_XS": LlamaFileType.MOSTLY_IQ2_XS,
    "IQ2_S": LlamaFileType.MOSTLY_IQ2_S, "IQ3_XXS": LlamaFileType.MOSTLY_IQ3_XXS,
    "IQ3_S": LlamaFileType.MOSTLY_IQ3_S, "IQ1_S": LlamaFileType.MOSTLY_IQ1_S,
    "IQ1_M": LlamaFileType.MOSTLY_IQ1_M,
}


def block_elems(qtype: str) -> int:
    """Weights per block of a GGUF type (1 for float types)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]


def is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama.cpp would quantize the tensor (a 2-D/3-D weight other than the router and rope)."""
    return len(shape) >= 2 and name.endswith(".weight") and ".ffn_gate_inp." not in name \
        and not name.startswith("rope_")


def fit(qtype: str, columns: int) -> str:
    """`qtype`, or llama.cpp's fallback for a row of `columns` weights that is not whole blocks."""
    if qtype in FLOAT_QTYPES or columns % block_elems(qtype) == 0:
        return qtype
    q = FALLBACK.get(qtype, qtype)
    return q if columns % block_elems(q) == 0 else "F16"


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every
    third one in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def tensor_types(shapes: Mapping[str, tuple[int, ...]], qtype: str, embed_qtype: str | None = None
                 ) -> dict[str, str]:
    """Stored type of every tensor of a Gemma 4 file (GGUF name -> type name) for `--qtype` `qtype`
    (one type, or a mix of MIXES) and an optional token-embedding override (`--embed-qtype`)."""
    if qtype not in QTYPE_CHOICES:
        raise ValueError(f"--qtype {qtype!r}: expected one of {', '.join(QTYPE_CHOICES)}")
    if embed_qtype is not None and embed_qtype not in (*BLOCK_QTYPES, *FLOAT_QTYPES):
        choices = ", ".join(BLOCK_QTYPES + FLOAT_QTYPES)
        raise ValueError(f"--embed-qtype {embed_qtype!r}: expected one of {choices}")
    base = MIXES.get(qtype, qtype)
    n_layers = 1 + max((_layer(n) for n in shapes if n.startswith("blk.")), default=-1)
    attn_v = [n for n in shapes if n.endswith(".attn_v.weight")]  # file order = layer order
    out: dict[str, str] = {}
    for name, shape in shapes.items():
        if not is_matrix(name, shape):
            out[name] = "F32"
            continue
        t = base
        if qtype in MIXES:
            if name == "token_embd.weight":
                t = "Q6_K" if shape[-1] % block_elems(base) == 0 else "Q8_0"
            elif name in attn_v and use_more_bits(attn_v.index(name), len(attn_v)):
                t = "Q6_K"
            elif ".ffn_down" in name and use_more_bits(_layer(name), n_layers):
                t = "Q6_K"
        if name == "token_embd.weight" and embed_qtype is not None:
            t = embed_qtype
        out[name] = fit(t, shape[-1])
    return out


def file_type(qtype: str) -> int:
    """general.file_type of a file written with `--qtype` `qtype`."""
    return int(FILE_TYPES[qtype])
