"""Parity of the whole image path with transformers' Gemma4ForConditionalGeneration (the oracle): a tiny
random text model (every 26B-A4B text feature, tests/models/hf_oracle.py) through our GGUF writer and
loader, its vision tower through our mmproj mapping, one prompt with an image between text. Our side
prepares the image (models/gemma4_image.py), encodes it (models/gemma4_vision.py) and places the rows at
the image's pad ids through the paged KV pools, in one chunk and in chunks that split the image."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.core import image_pad_ids
from swaserve.engine.moe import get_moe_backend
from swaserve.models.demo.tiny import write_gguf
from swaserve.models.gemma4 import Gemma4Model
from swaserve.models.gemma4_image import content_hash, prepare_image
from swaserve.models.gemma4_vision import Gemma4Vision
from swaserve.models.gguf_loader import load_gguf
from swaserve.models.mmproj import hf_state_to_gguf, vision_config_from_hf
from tests.models.hf_oracle import PagedRunner, build_hf_model, gguf_tensors, model_config, tiny_hf_config
from tests.models.test_gemma4_vision import _image, _randomize

IMAGE, BOI, EOI = 299, 297, 298
TOL = 1e-3
BUDGET = 70


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tcfg = tiny_hf_config(window=16, vocab=300)
    causal = build_hf_model(tcfg, seed=0)
    vision = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=256, standardize=True, use_clipped_linears=True)
    cfg = Gemma4Config(text_config=tcfg.to_dict(), vision_config=vision, audio_config=None,
                       image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI, video_token_id=296,
                       audio_token_id=295, boa_token_id=294, eoa_token_index=293)
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(cfg).eval()
    _randomize(hf, seed=1)
    text_sd = {k[len("model."):]: v for k, v in causal.state_dict().items() if k.startswith("model.")}
    missing, unexpected = hf.model.language_model.load_state_dict(text_sd, strict=False)
    assert not unexpected and not [k for k in missing if "layer_scalar" not in k], (missing, unexpected)
    for name, buf in causal.named_buffers():  # the layer scalars are buffers
        if name.endswith("layer_scalar"):
            dict(hf.model.language_model.named_buffers())[name[len("model."):]].copy_(buf)
    hf.tie_weights()
    hf.config.text_config._attn_implementation = "eager"
    path = str(tmp_path_factory.mktemp("mm") / "text.gguf")
    write_gguf(path, model_config(tcfg), gguf_tensors(causal),
               {"tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}, qtype="F32")
    loaded = load_gguf(path, progress=False)
    ours = Gemma4Model(loaded.config, loaded.weights, TorchAttentionBackend(),
                       get_moe_backend("torch", loaded.config, loaded.weights.experts, "cpu"), "cpu")
    vc = hf.config.vision_config
    enc = Gemma4Vision(vision_config_from_hf(vc, tcfg.hidden_size), hf_state_to_gguf(hf.state_dict(), vc))
    return hf, ours, enc, loaded.config


def _prompt(n_soft: int) -> tuple[list[int], int]:
    head = [2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, BOI]
    tail = [EOI, 30, 31, 32, 33, 34, 35, 36]
    return head + [IMAGE] * n_soft + tail, len(head)


def test_image_prompt_logprobs_match_transformers(pair) -> None:
    hf, ours, enc, cfg = pair
    img = _image(200, 150, seed=5)
    p = prepare_image(img, max_soft_tokens=BUDGET)
    ids, at = _prompt(p.num_soft_tokens)
    batch = Gemma4ImageProcessorPil()(images=[img], return_tensors="pt", max_soft_tokens=BUDGET)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"],
                  image_position_ids=batch["image_position_ids"], use_cache=False).logits[0].float()
    rows = enc.encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))  # [n, H]
    keyed = list(ids)
    keyed[at:at + p.num_soft_tokens] = image_pad_ids(content_hash(p), p.num_soft_tokens, cfg.vocab_size)
    span = torch.arange(at, at + p.num_soft_tokens)

    def run(cuts: list[int]) -> torch.Tensor:
        runner = PagedRunner(ours, cfg, page_size=8, max_len=len(ids) + 8, max_seqs=1)
        out, start = [], 0
        for end in cuts + [len(ids)]:
            sel = (span >= start) & (span < end)
            mm = (span[sel] - start, rows[span[sel] - at]) if bool(sel.any()) else None
            out.append(runner.step([(0, keyed[start:end])], images=mm)[0])
            start = end
        return torch.cat(out)

    ref = torch.log_softmax(want, -1)
    for cuts in ([], [at + 5], [at + 3, at + 40, len(ids) - 4]):  # whole, and chunks splitting the image
        got = torch.log_softmax(run(cuts), -1)
        err = float((got - ref).abs().max())
        print(f"cuts {cuts}: max |dlogprob| {err:.2e} over {len(ids)} positions ({p.num_soft_tokens} image)")
        assert err <= TOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))  # greedy tokens equal at every position
    # the image matters: without its rows (pad embeddings instead) the logprobs move far
    runner = PagedRunner(ours, cfg, page_size=8, max_len=len(ids) + 8, max_seqs=1)
    blind = torch.log_softmax(runner.step([(0, [t if t < cfg.vocab_size else 0 for t in keyed])])[0], -1)
    assert float((blind - ref)[at + p.num_soft_tokens:].abs().max()) > 100 * TOL
