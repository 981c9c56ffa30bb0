"""Parity of the whole image path with transformers' Gemma4ForConditionalGeneration (the oracle): a tiny
random text model (every 26B-A4B text feature, tests/models/hf_oracle.py) through our GGUF writer and
loader, its vision tower through our mmproj mapping, one prompt with an image between text. Our side
prepares the image (models/gemma4_image.py), encodes it (models/gemma4_vision.py) and places the rows at
the image's pad ids through the paged KV pools, in one chunk and in chunks that split the image (causal
image attention, transformers' default), and with use_bidirectional_attention "vision" (the image's tokens
see each other on the sliding layers) in the scheduler's chunks and after a prefix hit inside the image."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from swaserve.engine.attention.torch_backend import TorchAttentionBackend
from swaserve.engine.core import Req, SamplingParams, image_pad_ids
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


def _pair(tmp_path_factory, bidirectional: bool):
    tcfg = tiny_hf_config(window=16, vocab=300)
    causal = build_hf_model(tcfg, seed=0)
    text = tcfg.to_dict() | ({"use_bidirectional_attention": "vision"} if bidirectional else {})
    vision = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=32, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=256, standardize=True, use_clipped_linears=True)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
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
    vcfg = vision_config_from_hf(vc, tcfg.hidden_size,
                                 use_bidirectional_attention=hf.config.text_config.use_bidirectional_attention)
    assert vcfg.bidirectional_attention == bidirectional
    enc = Gemma4Vision(vcfg, hf_state_to_gguf(hf.state_dict(), vc))
    return hf, ours, enc, loaded.config


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' default text config (no use_bidirectional_attention): causal image attention."""
    return _pair(tmp_path_factory, bidirectional=False)


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


# ---- bidirectional image attention (text_config.use_bidirectional_attention == "vision") ----

@pytest.fixture(scope="module")
def bidir_pair(tmp_path_factory):
    return _pair(tmp_path_factory, bidirectional=True)


def _scheduler_cuts(start: int, end: int, span: tuple[int, int], budget: int) -> list[int]:
    """The chunk ends the scheduler makes for positions [start, end) at --chunked-prefill-size `budget`
    (Req.chunk_end: never inside the image)."""
    req = Req("r", "r", 0, [0] * end, end, SamplingParams(), attn_blocks=(span,))
    cuts = []
    while start < end:
        start = req.chunk_end(start, min(end, start + budget))
        cuts.append(start)
    return cuts


def test_bidirectional_image_logprobs_match_transformers(bidir_pair) -> None:
    """Forced-sequence logprobs vs Gemma4ForConditionalGeneration with bidirectional image attention: the
    whole prompt, the scheduler's chunks at budgets that would split the image, and a second prompt (same
    image, another question) whose prefix hit ends inside the image (page-aligned, as the radix cache
    matches), against transformers and against its own run from scratch."""
    hf, ours, enc, cfg = bidir_pair
    img = _image(200, 150, seed=5)
    p = prepare_image(img, max_soft_tokens=BUDGET)
    n = p.num_soft_tokens
    ids, at = _prompt(n)
    second = ids[:at + n] + [EOI, 40, 41, 42, 43, 44]
    pre = Gemma4ImageProcessorPil()(images=[img], return_tensors="pt", max_soft_tokens=BUDGET)

    def oracle(prompt: list[int], mm: bool = True) -> torch.Tensor:
        t = torch.tensor([prompt])
        with torch.no_grad():
            return torch.log_softmax(hf(input_ids=t, pixel_values=pre["pixel_values"],
                                        image_position_ids=pre["image_position_ids"],
                                        mm_token_type_ids=(t == IMAGE).long() if mm else None,
                                        use_cache=False).logits[0].float(), -1)

    rows = enc.encode(torch.from_numpy(p.pixel_values), torch.from_numpy(p.position_ids))  # [n, H]
    pads = image_pad_ids(content_hash(p), n, cfg.vocab_size)
    span = (at, at + n)
    blocks = {0: (span,), 1: (span,)}
    runner = PagedRunner(ours, cfg, page_size=8, max_len=len(ids) + 8, max_seqs=2)

    def run(seq: int, prompt: list[int], start: int, cuts: list[int]) -> torch.Tensor:
        keyed = prompt[:at] + pads + prompt[at + n:]
        out = []
        for end in cuts:
            lo, hi = max(at, start), min(at + n, end)
            mm = (torch.arange(lo, hi) - start, rows[lo - at:hi - at]) if lo < hi else None
            out.append(runner.step([(seq, keyed[start:end])], images=mm, attn_blocks=blocks)[0])
            start = end
        runner.lens.pop(seq)
        return torch.log_softmax(torch.cat(out), -1)

    ref = oracle(ids)
    causal_ref = oracle(ids, mm=False)  # transformers without mm_token_type_ids: causal
    moved = float((ref - causal_ref).abs().max())
    print(f"transformers, bidirectional vs causal image attention: max |dlogprob| {moved:.2f}")
    assert moved > 100 * TOL  # the mask matters on this model
    for budget in (None, 20, 7):  # whole; then chunks cut before the image and one chunk for the image
        cuts = [len(ids)] if budget is None else _scheduler_cuts(0, len(ids), span, budget)
        assert not any(at < c < at + n for c in cuts)
        got = run(0, ids, 0, cuts)
        err = float((got - ref).abs().max())
        print(f"bidirectional, chunks ending at {cuts}: max |dlogprob| {err:.2e} over {len(ids)} positions "
              f"({n} image)")
        assert err <= TOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    with pytest.raises(AssertionError, match="splits the image"):  # a chunk inside the image is refused
        run(0, ids, 0, [at + 5, len(ids)])
    runner.lens.pop(0, None)

    # a prefix hit inside the image: sequence 1 (another question) starts from sequence 0's first pages
    hit = (at + n // 2) // 8 * 8
    assert at < hit < at + n
    run_first = _scheduler_cuts(0, len(ids), span, 20)
    keyed = ids[:at] + pads + ids[at + n:]
    start = 0
    for end in run_first:  # sequence 0 computes the first prompt, its KV stays
        lo, hi = max(at, start), min(at + n, end)
        mm = (torch.arange(lo, hi) - start, rows[lo - at:hi - at]) if lo < hi else None
        runner.step([(0, keyed[start:end])], images=mm, attn_blocks=blocks)
        start = end
    runner.share_prefix(0, 1, hit)
    cuts = _scheduler_cuts(hit, len(second), span, 20)
    assert cuts[0] == at + n  # the rest of the image in one chunk
    cached = run(1, second, hit, cuts)
    runner.lens.pop(0)
    scratch = run(0, second, 0, [len(second)])[hit:]
    ref2 = oracle(second)[hit:]
    err, err_scratch = float((cached - ref2).abs().max()), float((cached - scratch).abs().max())
    print(f"bidirectional, prefix hit at {hit} inside the image [{at}, {at + n}), chunks {cuts}: max "
          f"|dlogprob| {err:.2e} vs transformers, {err_scratch:.2e} vs scratch")
    assert err <= TOL and err_scratch <= TOL
    assert torch.equal(cached.argmax(-1), ref2.argmax(-1))
    assert torch.equal(cached.argmax(-1), scratch.argmax(-1))
