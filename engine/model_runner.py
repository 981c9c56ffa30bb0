"""Glue between the scheduler's Batch and the model: attention metadata, forward, logits, sampling."""

from __future__ import annotations

import torch

from swaserve.engine.attention.base import AttentionMetadata
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.core import Batch, Req, TokenLogprob
from swaserve.engine.grammar import GrammarBackend, GrammarState
from swaserve.engine.model_api import CausalLM
from swaserve.engine.sampling import SampleRow, make_generator, sample_isolated


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_metadata(batch: Batch, page_size: int, window: int, device: torch.device | str = "cpu"
                   ) -> AttentionMetadata:
    """Positions, slots and page tables of both pools for one batch (built on the CPU, then moved)."""
    P, W = page_size, window
    B = len(batch.reqs)
    npages = [_cdiv(p + q, P) for p, q in zip(batch.prefix_lens, batch.q_lens)]
    width = max(npages)
    full_rows: list[list[int]] = []
    swa_rows: list[list[int]] = []
    for r, p, n in zip(batch.reqs, batch.prefix_lens, npages):
        full_rows.append(r.full_pages[:n] + [-1] * (width - n))
        lo = max(0, p - W + 1) // P  # first page a new token can see on sliding layers
        swa = [-1] * lo + [-1 if s is None else s for s in r.swa_pages[lo:n]] + [-1] * (width - n)
        swa_rows.append(swa)
    full_table = torch.tensor(full_rows, dtype=torch.int64)  # [B, width]
    swa_table = torch.tensor(swa_rows, dtype=torch.int64)  # [B, width]
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(batch.q_lens))  # [T]
    starts = torch.tensor(batch.prefix_lens, dtype=torch.int64)
    cu = torch.tensor([0] + batch.q_lens, dtype=torch.int64).cumsum(0)  # [B + 1]
    positions = torch.arange(int(cu[-1]), dtype=torch.int64) - cu[seq] + starts[seq]  # [T]
    page_idx, off = positions // P, positions % P  # [T]
    full_slots = full_table[seq, page_idx] * P + off  # [T]
    swa_pg = swa_table[seq, page_idx]  # [T]
    assert bool((swa_pg >= 0).all()) and bool((full_table[seq, page_idx] >= 0).all()), "unmapped slot"
    swa_slots = swa_pg * P + off  # [T]
    meta = AttentionMetadata(P, W, list(batch.q_lens), list(batch.prefix_lens), positions, full_slots,
                             swa_slots, full_table, swa_table)
    return meta.to(device) if torch.device(device).type != "cpu" else meta


class ModelRunner:
    """Runs one Batch: forward over the paged pools, logits of the sampling rows, sampling."""

    def __init__(self, model: CausalLM, pool: KVPool, page_size: int, window: int, device: torch.device):
        self.model = model
        self.pool = pool
        self.page_size = page_size
        self.window = window
        self.device = device
        self.grammar: GrammarBackend | None = None  # set by the engine (needs the tokenizer)
        # requests whose own data failed the last execute (their grammar, their sampling row): the engine
        # fails them alone; their token in the result is meaningless
        self.failed: dict[Req, Exception] = {}

    def execute(self, batch: Batch) -> tuple[list[int | None], list[TokenLogprob | None]]:
        self.failed = {}
        meta = build_metadata(batch, self.page_size, self.window, self.device)
        ids = torch.tensor(batch.input_ids(), dtype=torch.int64, device=self.device)  # [T]
        hidden = self.model.forward(ids, meta, self.pool)  # [T, H]
        cu = meta.cu_q_lens
        sel = [b for b, s in enumerate(batch.sample) if s]
        tokens: list[int | None] = [None] * len(batch.reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(batch.reqs)
        if not sel:
            return tokens, logprobs
        rows_idx = torch.tensor([cu[b + 1] - 1 for b in sel], dtype=torch.int64, device=hidden.device)
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
                                  r.token_ids[:r.prompt_len] if p.repetition_penalty != 1.0 else (),
                                  r.output_ids if penal else (), banned))
        bitmask = self.grammar.fill(states) if states and self.grammar is not None else None
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
