"""The fake model and tier bytes of bench/cache_sim.py: AnswerModel plays the model (each request's
predetermined answer) and, with check=True, the KV pools; SimTierIO stores the second tier's records as
those pools' (position, token) entries, so promoted KV is checked like computed KV."""

from __future__ import annotations

from typing import Any

from swaserve.engine.core import Batch, Req
from swaserve.engine.kvcache.tier.index import DictTierIO


def write_and_verify(full: dict[int, tuple[int, int]], swa: dict[int, tuple[int, int]], r: Req, start: int,
                     end: int, page_size: int, window: int) -> None:
    """Play the KV pools for r's new positions [start, end): write each one's (position, token) into its
    full and SWA slots (slot -> entry dicts), then read back every position the last of them attends to
    (all of [0, end) in the full pool, the last `window` in the SWA pool) and assert it holds its token."""
    P, W = page_size, window
    for pos in range(start, end):
        tok = r.token_ids[pos]
        full[r.full_pages[pos // P] * P + pos % P] = (pos, tok)
        sp = r.swa_pages[pos // P]
        assert sp is not None, f"{r.rid}: no SWA page for new position {pos}"
        swa[sp * P + pos % P] = (pos, tok)
    for i in range(end):
        got = full.get(r.full_pages[i // P] * P + i % P)
        assert got == (i, r.token_ids[i]), f"{r.rid}: full KV of position {i} is {got}"
    for i in range(max(0, end - W), end):
        sp = r.swa_pages[i // P]
        assert sp is not None, f"{r.rid}: SWA page of position {i} dropped (seq {end})"
        got = swa.get(sp * P + i % P)
        assert got == (i, r.token_ids[i]), f"{r.rid}: SWA KV of position {i} is {got}"


class AnswerModel:
    """The fake model: for a sampling row returns the next token of the request's predetermined answer.
    With check=True it also plays the KV pool: every new token's (position, token) is written into its
    full and SWA slots, and every position the last new token would attend to is read back and
    compared (all of [0, end) in the full pool, the last `window` positions in the SWA pool)."""

    def __init__(self, page_size: int, window: int, check: bool = False):
        self.page_size, self.window, self.check = page_size, window, check
        self.answers: dict[str, tuple[int, ...]] = {}
        self.full: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.swa: dict[int, tuple[int, int]] = {}

    def __call__(self, batch: Batch) -> list[int | None]:
        out: list[int | None] = []
        for r, start, q, sample in zip(batch.reqs, batch.prefix_lens, batch.q_lens, batch.sample):
            if self.check:
                self._write_and_verify(r, start, start + q)
            out.append(self.answers[r.rid][r.output_len] if sample else None)
        return out

    def _write_and_verify(self, r: Req, start: int, end: int) -> None:
        write_and_verify(self.full, self.swa, r, start, end, self.page_size, self.window)


class SimTierIO(DictTierIO):
    """The tier's bytes in the simulation: a record is the (position, token) entries of the page's slots in
    the fake model's pools (None without --check), so promoted KV is checked like computed KV."""

    def __init__(self, model: AnswerModel, full_per_block: int):
        super().__init__({}, {"full": 1, "swa": full_per_block})  # "bytes" in full pages
        self.model = model

    def _pool(self, kind: str) -> dict[int, tuple[int, int]]:
        return self.model.full if kind == "full" else self.model.swa

    def get_page(self, kind: str, page: int) -> Any:
        if not self.model.check:
            return None
        P, pool = self.model.page_size, self._pool(kind)
        return tuple(pool.get(page * P + j) for j in range(P))

    def put_page(self, kind: str, page: int, content: Any) -> None:
        if content is None:
            return
        P, pool = self.model.page_size, self._pool(kind)
        for j, entry in enumerate(content):
            if entry is None:
                pool.pop(page * P + j, None)
            else:
                pool[page * P + j] = entry
