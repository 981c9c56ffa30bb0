"""Random Gemma 4 GGUF models: presets `tiny` (tests, demo), `small` (CPU benchmarks), `26b-a4b` (real
shapes, GPU benchmarks) and `swaserve make-model`. The weights are random but scaled so activations
stay O(1); norm weights, router scales, per-expert scales and layer scalars are randomised too."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from swaserve.engine.config import ModelConfig
from swaserve.models.demo.quant_mix import BLOCK_QTYPES, FLOAT_QTYPES, MIXES, tensor_types
from swaserve.models.demo.random_blocks import random_blocks
from swaserve.models.demo.tiny_writer import QUANTIZABLE, WRITE_QTYPES, RawTensor, write_gguf
from swaserve.models.gemma4_layout import tensor_shapes

__all__ = [
    "PRESETS", "RawTensor", "add_make_model_args", "demo_mmproj_path", "demo_model_path", "make_model",
    "preset_config",
    "random_tensors", "run_make_model", "write_gguf",
]

log = logging.getLogger(__name__)

_SLIDING, _FULL = "sliding", "full"
# ModelConfig fields per preset; vocab_size None = the demo tokenizer's size.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=None, hidden_size=64, num_layers=6, num_heads=4,
        layer_types=(_SLIDING,) * 5 + (_FULL,),
        head_dim_swa=32, head_dim_full=64, num_kv_heads_swa=2, num_kv_heads_full=1, sliding_window=64,
        intermediate_size=64, moe_intermediate_size=32, num_experts=8, top_k_experts=2,
        rope_dims_swa=32, rope_dims_full=64, rope_full_rotated_pairs=8, context_length=32768,
    ),
    "small": dict(
        vocab_size=None, hidden_size=1024, num_layers=12, num_heads=8,
        layer_types=((_SLIDING,) * 5 + (_FULL,)) * 2,
        head_dim_swa=128, head_dim_full=256, num_kv_heads_swa=4, num_kv_heads_full=1, sliding_window=1024,
        intermediate_size=1024, moe_intermediate_size=256, num_experts=32, top_k_experts=4,
        rope_dims_swa=128, rope_dims_full=256, rope_full_rotated_pairs=32, context_length=32768,
    ),
    "26b-a4b": dict(
        vocab_size=262144, hidden_size=2816, num_layers=30, num_heads=16,
        layer_types=((_SLIDING,) * 5 + (_FULL,)) * 5,
        head_dim_swa=256, head_dim_full=512, num_kv_heads_swa=8, num_kv_heads_full=2, sliding_window=1024,
        intermediate_size=2112, moe_intermediate_size=704, num_experts=128, top_k_experts=8,
        rope_dims_swa=256, rope_dims_full=512, rope_full_rotated_pairs=64, context_length=262144,
    ),
}


def _tokenizer_meta() -> dict[str, Any]:
    from swaserve.models.demo.tokenizer import demo_tokenizer_metadata

    return dict(demo_tokenizer_metadata())


def preset_config(name: str, vocab_size: int | None = None) -> ModelConfig:
    """The ModelConfig of preset `name` (vocab: `vocab_size`, the preset's, or the demo tokenizer's)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if vocab_size is None and fields["vocab_size"] is None:
        vocab_size = len(_tokenizer_meta()["tokenizer.ggml.tokens"])
    fields["vocab_size"] = vocab_size or fields["vocab_size"]
    return ModelConfig(**fields)


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[str, float, float]:
    """(distribution, a, b) for a tensor: ("normal", 0, std) or ("uniform", lo, hi)."""
    base = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if base == "token_embd.weight":
        return "normal", 0.0, 1.5 / cfg.hidden_size**0.5
    if base == "ffn_gate_inp.weight":
        return "normal", 0.0, 2.0
    if base in ("ffn_gate_inp.scale", "ffn_down_exps.scale"):
        return "uniform", 0.5, 1.5
    if base == "layer_output_scale.weight":
        return "uniform", 0.5, 1.0
    if base.startswith("post_"):
        return "uniform", 0.3, 0.8
    if len(shape) == 1:  # pre-norms, q/k norms, final norm
        return "uniform", 0.7, 1.3
    return "normal", 0.0, 1.0 / shape[-1] ** 0.5  # projections: fan-in scaling


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def _random_fp32(name: str, shape: tuple[int, ...], cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    if name == "rope_freqs.weight":  # proportional rope: 1.0 for rotated pairs, 1e30 (no rotation) after
        f = np.full(shape, 1e30, dtype=np.float32)
        f[: cfg.rope_full_rotated_pairs] = 1.0
        return f
    dist, a, b = _init(name, shape, cfg)
    if dist == "uniform":
        return rng.uniform(a, b, size=shape).astype(np.float32)
    return rng.standard_normal(size=shape, dtype=np.float32) * np.float32(b)


class LazyTensors(Mapping[str, "np.ndarray | RawTensor"]):
    """Random tensors generated on access (the writer streams them to disk one at a time).

    `types` (GGUF name -> stored type, models/quant_mix.tensor_types) says which tensors are block
    matrices; those are generated directly as random blocks (models/demo/random_blocks.py: no fp32 pass,
    fast for the 26b preset) when `raw` is set or when gguf has no quantizer for their type; all
    others are fp32 arrays (quantized by the writer)."""

    def __init__(self, cfg: ModelConfig, seed: int, types: Mapping[str, str] | None = None,
                 raw: bool = False):
        self.cfg, self.seed, self.raw = cfg, seed, raw
        self.shapes = tensor_shapes(cfg)
        self.types = dict(types or {})
        self._index = {n: i for i, n in enumerate(self.shapes)}

    def __getitem__(self, name: str) -> np.ndarray | RawTensor:
        shape = self.shapes[name]
        rng = _rng(self.seed, self._index[name])
        qtype = self.types.get(name, "F32")
        if qtype not in ("F32", "F16", "BF16") and (self.raw or qtype not in QUANTIZABLE):
            _, _, std = _init(name, shape, self.cfg)
            return RawTensor(qtype, random_blocks(qtype, shape, std, rng), shape)
        return _random_fp32(name, shape, self.cfg, rng)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """All tensors of a random model: GGUF names -> fp32 arrays in torch order."""
    lazy = LazyTensors(cfg, seed)
    return {n: lazy[n] for n in lazy}  # type: ignore[misc]


def fit_vocab(meta: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Pad the tokenizer's token list with `<unusedN>` control tokens up to `vocab_size`."""
    toks = list(meta["tokenizer.ggml.tokens"])
    if len(toks) > vocab_size:
        raise ValueError(f"tokenizer has {len(toks)} tokens, more than the model's vocab {vocab_size}")
    n = vocab_size - len(toks)
    if n:
        meta = dict(meta)
        meta["tokenizer.ggml.tokens"] = toks + [f"<unused{i}>" for i in range(n)]
        if "tokenizer.ggml.scores" in meta:
            meta["tokenizer.ggml.scores"] = list(meta["tokenizer.ggml.scores"]) + [0.0] * n
        if "tokenizer.ggml.token_type" in meta:
            meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [3] * n
    return meta


def make_model(preset: str, out: str, seed: int = 0, progress: bool = True, qtype: str = "Q4_0",
               embed_qtype: str | None = None) -> str:
    """Write a random model of `preset` to `out` (streamed; atomically renamed into place) with its
    matrices in `qtype` (a type or a llama.cpp mix) and the token embedding in `embed_qtype` if given."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
    meta = _tokenizer_meta()
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    cfg = preset_config(preset, vocab_size=PRESETS[preset]["vocab_size"] or n_tokens)
    meta = fit_vocab(meta, cfg.vocab_size)
    types = tensor_types(tensor_shapes(cfg), qtype, embed_qtype)
    tensors = LazyTensors(cfg, seed, types, raw=(preset == "26b-a4b"))
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        write_gguf(tmp, cfg, tensors, meta, qtype=qtype, progress=progress, name=f"swaserve-random-{preset}",
                   embed_qtype=embed_qtype)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s, %.1f MB)", out_path, preset, out_path.stat().st_size / 1e6)
    return str(out_path)


def _demo_fingerprint() -> str:
    """Hash of the sources that determine the demo model (a changed generator gives a new file)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for f in ("tiny.py", "tiny_writer.py", "../gemma4_layout.py", "quant_mix.py", "random_blocks.py",
              "tokenizer.py", "chat_template.jinja"):
        p = here / f
        h.update(p.read_bytes() if p.exists() else b"-")
    return h.hexdigest()[:12]


def demo_model_path() -> str:
    """The demo model (`tiny` preset, seed 0), generated once into $SWASERVE_CACHE or ~/.cache/swaserve."""
    cache = Path(os.environ.get("SWASERVE_CACHE") or Path.home() / ".cache" / "swaserve")
    path = cache / f"swaserve-demo-tiny-{_demo_fingerprint()}.gguf"
    if not path.exists():
        log.info("generating the demo model into %s", path)
        make_model("tiny", str(path), seed=0, progress=False)
    return str(path)


def make_mmproj(preset: str, out_path: str, seed: int = 0, size: str = "tiny") -> str:
    """A random gemma4v vision projector for `preset`'s hidden size, as llama.cpp's mmproj GGUF: what
    `make-model --vision` writes beside the model. size "tiny": models/mmproj.py tiny_vision_config;
    "real": Gemma 4's tower (768 wide, 16 layers, up to 280 soft tokens an image)."""
    from swaserve.models.gemma4_vision import VisionConfig
    from swaserve.models.mmproj import random_vision, tiny_vision_config, write_mmproj

    hidden = int(PRESETS[preset]["hidden_size"])
    vcfg = tiny_vision_config(hidden) if size == "tiny" else VisionConfig(text_hidden_size=hidden)
    tmp = f"{out_path}.tmp{os.getpid()}"
    try:
        write_mmproj(tmp, vcfg, random_vision(vcfg, seed))
        os.replace(tmp, out_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out_path


def demo_mmproj_path() -> str:
    """The demo model's image encoder, generated once beside it."""
    h = hashlib.sha256()  # a changed generator gives a new file
    for f in ("gemma4_vision.py", "mmproj.py"):
        h.update((Path(__file__).parent.parent / f).read_bytes())
    tag = h.hexdigest()[:8]
    path = Path(demo_model_path()).with_suffix(f".{tag}.mmproj.gguf")
    if not path.exists():
        make_mmproj("tiny", str(path), seed=0)
    return str(path)


def add_make_model_args(p: argparse.ArgumentParser) -> None:
    """Flags of `swaserve make-model`."""
    p.add_argument("--preset", choices=list(PRESETS), default="tiny", help="model size (default: tiny)")
    p.add_argument("--out", required=True, help="output GGUF file")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--qtype", choices=list(WRITE_QTYPES), default="Q4_0", metavar="QTYPE",
                   help=f"stored type of the large matrices (default: Q4_0): one of "
                        f"{', '.join(BLOCK_QTYPES + FLOAT_QTYPES)}, or a llama.cpp mix: {', '.join(MIXES)}; "
                        "norms/router/scalars are F32; rows that are not whole blocks fall back as "
                        "llama-quantize does")
    p.add_argument("--embed-qtype", choices=list(BLOCK_QTYPES + FLOAT_QTYPES), default=None,
                   metavar="QTYPE", help="stored type of the token embedding / tied lm_head (default: as "
                   "--qtype; llama-quantize writes Q6_K here for Q4_0, Q4_K_M, Q5_K_M and Q6_K files)")
    p.add_argument("--vision-size", choices=("tiny", "real"), default="tiny",
                   help="with --vision: a tiny tower (demo, tests) or Gemma 4's own shape (benchmarks)")
    p.add_argument("--vision", action="store_true",
                   help="also write a random gemma4v image encoder, OUT with .mmproj.gguf for .gguf "
                        "(serve it with --mmproj)")
    p.add_argument("--vision-into-main", action="store_true",
                   help="with --vision: put the encoder's keys and tensors into OUT itself (one combined "
                        "file, served with no --mmproj) instead of a separate .mmproj.gguf")


def run_make_model(args: argparse.Namespace) -> int:
    """`swaserve make-model`: writes the file and prints its path and size."""
    qtype = getattr(args, "qtype", "Q4_0")
    path = make_model(args.preset, args.out, seed=args.seed, progress=True, qtype=qtype,
                      embed_qtype=getattr(args, "embed_qtype", None))
    print(f"{path} ({Path(path).stat().st_size / 1e6:.1f} MB, preset {args.preset})")
    into_main = getattr(args, "vision_into_main", False)
    if into_main and not getattr(args, "vision", False):
        raise ValueError("--vision-into-main needs --vision")
    if getattr(args, "vision", False):
        mm = make_mmproj(args.preset, str(Path(path).with_suffix(".mmproj.gguf")), seed=args.seed,
                         size=getattr(args, "vision_size", "tiny"))
        if into_main:
            from swaserve.models.mmproj import combine_gguf

            tmp = f"{path}.tmp{os.getpid()}"
            try:
                combine_gguf(path, mm, tmp)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
                Path(mm).unlink(missing_ok=True)
            print(f"{path} ({Path(path).stat().st_size / 1e6:.1f} MB, image encoder inside: serve with no "
                  "--mmproj)")
        else:
            print(f"{mm} ({Path(mm).stat().st_size / 1e6:.1f} MB, image encoder for --mmproj)")
    return 0
