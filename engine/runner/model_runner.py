"""Glue between the scheduler's Batch and the model: attention metadata, forward, logits, sampling."""

from __future__ import annotations

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.core import Batch, Req, TokenLogprob
from swaserve.engine.model_api import CausalLM
from swaserve.engine.runner import prompt_logprobs
from swaserve.engine.runner.cuda_graphs import DecodeGraphs
from swaserve.engine.runner.images import ImageEmbedder
from swaserve.engine.runner.sampling import SampleRow, make_generator, sample_isolated
from swaserve.engine.runner.staging import pack_to_device, to_device
from swaserve.engine.text.grammar import GrammarBackend, GrammarState


def _vocab_ids(r: Req, vocab: int) -> list[int]:
    """The prompt's ids for the repetition penalty: an image's pad ids (all >= vocab) are no token."""
    ids = r.token_ids[:r.prompt_len]
    return [t for t in ids if t < vocab] if r.images else ids


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_ends(batch: Batch) -> list[int] | None:
    """AttentionMetadata.key_ends of a batch: [T] one past the last key each new token sees on the sliding
    layers (an image soft token: its span's end, Req.attn_blocks), or None when no token sees past itself."""
    if not any(r.attn_blocks for r in batch.reqs):  # every step without a bidirectional image: causal
        return None
    out: list[int] = []
    seen = False
    for r, p, q in zip(batch.reqs, batch.prefix_lens, batch.q_lens):
        ends = list(range(p + 1, p + q + 1))
        for lo, hi in r.attn_blocks:
            a, b = max(lo, p), min(hi, p + q)
            if a < b:
                assert hi <= p + q, f"{r.rid}: the chunk [{p}, {p + q}) splits the image span [{lo}, {hi})"
                ends[a - p:b - p] = [hi] * (b - a)
                seen = seen or hi > a + 1
        out += ends
    return out if seen else None


def build_metadata(batch: Batch, page_size: int, window: int, device: torch.device | str = "cpu"
                   ) -> AttentionMetadata:
    """Positions, slots and page tables of both pools for one batch.

    Built from the batch's Python lists on the host and staged to the device in two copies (int64,
    int32) that do not wait for the device (engine/runner/staging.py): no host synchronisation."""
    B = len(batch.reqs)
    npages = [_cdiv(p + q, page_size) for p, q in zip(batch.prefix_lens, batch.q_lens)]
    width = max(npages)
    full_rows: list[int] = []  # [B * width] row-major page tables, -1 = no page
    swa_rows: list[int] = []
    positions: list[int] = []  # [T]
    full_slots: list[int] = []
    swa_slots: list[int] = []
    for r, p, q, n in zip(batch.reqs, batch.prefix_lens, batch.q_lens, npages):
        full = r.full_pages[:n] + [-1] * (width - n)
        lo = max(0, p - window + 1) // page_size  # first page a new token can see on sliding layers
        swa = [-1] * lo + [-1 if s is None else s for s in r.swa_pages[lo:n]] + [-1] * (width - n)
        full_rows += full
        swa_rows += swa
        for pos in range(p, p + q):
            page, off = divmod(pos, page_size)
            assert full[page] >= 0 and swa[page] >= 0, f"unmapped slot at position {pos} of {r.rid}"
            positions.append(pos)
            full_slots.append(full[page] * page_size + off)
            swa_slots.append(swa[page] * page_size + off)
    cu = [0]
    for q in batch.q_lens:
        cu.append(cu[-1] + q)
    decodes = [b for b, q in enumerate(batch.q_lens) if q == 1]
    pos_t, full_t, swa_t, ftab, stab = pack_to_device(
        [positions, full_slots, swa_slots, full_rows, swa_rows], torch.int64, device)
    ends = key_ends(batch)
    cu_t, prefix_t, dec_t, ends_t = pack_to_device([cu, batch.prefix_lens, decodes, ends or []], torch.int32,
                                                   device)
    return AttentionMetadata(page_size, window, list(batch.q_lens), list(batch.prefix_lens), pos_t, full_t,
                             swa_t, ftab.view(B, width), stab.view(B, width), cu_q_lens_t=cu_t,
                             prefix_lens_t=prefix_t, decode_seqs_t=dec_t, key_ends=ends,
                             key_ends_t=ends_t if ends is not None else None)


class ModelRunner:
    """Runs one Batch: forward over the paged pools, logits of the sampling rows, sampling; the prompt
    logprobs of the prefill rows that need them (engine/runner/prompt_logprobs.py)."""

    def __init__(self, model: CausalLM, pool: KVPool, page_size: int, window: int, device: torch.device,
                 logprob_rows: int = 64):
        self.model = model
        self.pool = pool
        self.page_size = page_size
        self.window = window
        self.device = device
        self.grammar: GrammarBackend | None = None  # set by the engine (needs the tokenizer)
        # requests whose own data failed the last execute (their grammar, their sampling row): the engine
        # fails them alone; their token in the result is meaningless
        self.failed: dict[Req, Exception] = {}
        # decode steps through static buffers / CUDA graphs per batch bucket (engine/runner/cuda_graphs.py);
        # set by the engine builder on CUDA, None = every step eager
        self.graphs: DecodeGraphs | None = None
        # prompt logprobs of the last execute, per request (engine/runner/prompt_logprobs.py), computed over
        # at most logprob_rows rows of all-vocabulary logits at a time
        self.prompt_logprobs: dict[Req, list[TokenLogprob]] = {}
        self.logprob_rows = logprob_rows
        # image soft tokens (engine/runner/images.py); set by the engine builder when an encoder is loaded
        self.images: ImageEmbedder | None = None

    def execute(self, batch: Batch) -> tuple[list[int | None], list[TokenLogprob | None]]:
        self.failed = {}
        self.prompt_logprobs = {}
        sel = [b for b, s in enumerate(batch.sample) if s]
        tokens: list[int | None] = [None] * len(batch.reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(batch.reqs)
        prompt_rows = prompt_logprobs.plan_rows(batch)
        bucket = self.graphs.bucket(batch) if self.graphs is not None and not prompt_rows else None
        if bucket is not None:  # decode-only: every row samples
            logits = self.graphs.run(batch, bucket)  # [B, V] fp32
        else:
            meta = build_metadata(batch, self.page_size, self.window, self.device)
            ids = to_device(batch.input_ids(), torch.int64, self.device)  # [T]
            mm = self.images.rows_for(batch, self.failed) if self.images is not None else None
            if mm is None:
                hidden = self.model.forward(ids, meta, self.pool)  # [T, H]
            else:
                hidden = self.model.forward(ids, meta, self.pool, images=mm)  # [T, H]
            if prompt_rows:
                self.prompt_logprobs = prompt_logprobs.compute(self.model, hidden, prompt_rows,
                                                               self.logprob_rows)
            cu = meta.cu_q_lens
            if not sel:
                return tokens, logprobs
            rows_idx = to_device([cu[b + 1] - 1 for b in sel], torch.int64, hidden.device)  # [S]
            logits = self.model.logits(hidden[rows_idx])  # [S, V] fp32
        rows = []
        grammar_rows: list[int] = []
        states: list[GrammarState] = []
        for j, b in enumerate(sel):
            r = batch.reqs[b]
            p = r.params
            if p.temperature > 0 and r.generator is None:
                r.generator = make_generator(r.seed)
            try:
                state = self._grammar_state(r)
            except Exception as e:  # noqa: BLE001 - this request's grammar: it fails alone
                self.failed[r] = e
                state = None
            if state is not None:
                grammar_rows.append(j)
                states.append(state)
            banned: list[int] = []
            if p.min_tokens and r.output_len < p.min_tokens and not (state is not None and state.done):
                banned = sorted(r.stop_ids)  # a finished grammar allows only EOS: it wins over min_tokens
            penal = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            rows.append(SampleRow(p, r.generator if p.temperature > 0 else None,  # type: ignore[arg-type]
                                  _vocab_ids(r, logits.shape[1]) if p.repetition_penalty != 1.0 else (),
                                  r.output_ids if penal else (), banned))
        bitmask = self.grammar.fill(states) if states and self.grammar is not None else None
        for j, st in zip(grammar_rows, states):  # a matcher that failed fails its request (GrammarFailed)
            failure = st.failure()
            if failure is not None:
                self.failed.setdefault(batch.reqs[sel[j]], failure)
        res, failed_rows = sample_isolated(logits, rows, grammar_rows, bitmask)
        for j, b in enumerate(sel):
            if j in failed_rows:
                self.failed.setdefault(batch.reqs[b], failed_rows[j])
            tokens[b] = res.token_ids[j]
            logprobs[b] = res.logprobs[j]
        return tokens, logprobs

    def _grammar_state(self, r: Req) -> GrammarState | None:
        """The Req's matcher, made at its first sample and brought up to date with its output ids."""
        if r.params.grammar is None or self.grammar is None:
            return None
        if r.grammar is None:
            r.grammar = self.grammar.new_state(r.params.grammar)
        state: GrammarState = r.grammar  # type: ignore[assignment]
        state.sync(r.output_ids)
        return state
