"""Batched sampling: penalties, logit_bias, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Order of operations for one row (SGLang / vLLM semantics):
  0. the grammar mask (structured output: tokens the row's grammar does not allow get -inf; only the
     constrained rows are touched) and, while fewer than min_tokens were generated, the stop ids;
  1. repetition penalty over prompt + output tokens (logit > 0: divided, else multiplied),
     frequency penalty (x count in the output) and presence penalty (output tokens), logit_bias;
  2. temperature 0 -> argmax of the penalised logits (first index on ties);
  3. otherwise divide by the temperature, then top-k (keep logits >= the k-th largest),
     top-p (smallest prefix of the stably sorted distribution whose mass reaches top_p),
     min-p (keep p >= min_p * max p), renormalise and draw one token by inverse CDF with one uniform
     from the request's own torch.Generator, so a seed gives the same tokens whatever else is batched.
Logprobs are those of the raw model distribution (log_softmax of the logits before step 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from swaserve.engine.core import SamplingParams, TokenLogprob
from swaserve.engine.runner.staging import to_device

_NEG_INF = float("-inf")


@dataclass
class SampleRow:
    """What the sampler needs to know about one sequence of the batch."""

    params: SamplingParams
    generator: torch.Generator | None  # required unless params.temperature == 0
    prompt_ids: Sequence[int] = ()  # for the repetition penalty
    output_ids: Sequence[int] = ()  # for all three penalties
    banned_ids: Sequence[int] = ()  # token ids that must not be sampled now (min_tokens: the stop ids)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the row did not ask for logprobs


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """In place on the rows that use penalties or logit_bias; logits [B, V] fp32."""
    V = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
            ids = list(r.prompt_ids) + list(r.output_ids)
            if ids:
                seen[to_device(ids, torch.long, logits.device)] = True
            row = logits[i]
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, pen, row)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and len(r.output_ids) > 0:
            counts = torch.zeros(V, dtype=logits.dtype, device=logits.device)
            ids_t = to_device(list(r.output_ids), torch.long, logits.device)
            counts.scatter_add_(0, ids_t, torch.ones_like(ids_t, dtype=logits.dtype))  # [V]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.logit_bias:
            idx = to_device([t for t, _ in p.logit_bias], torch.long, logits.device)
            val = to_device([b for _, b in p.logit_bias], logits.dtype, logits.device)
            logits[i].index_add_(0, idx, val)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, device: torch.device | str = "cpu",
                   invert: bool = False) -> torch.Tensor:
    """int32 [R, W] (bit t % 32 of word t // 32 = token t allowed) -> bool [R, vocab] on `device`, True
    where allowed (tokens past 32 * W are not), or with `invert` True where disallowed. On CPU numpy
    unpacks the bits; elsewhere bit operations run on the device after one small copy (4 bytes per 32
    tokens)."""
    R, W = bitmask.shape
    n = min(vocab, 32 * W)
    if torch.device(device).type == "cpu":
        words = bitmask.numpy()
        if invert:
            words = ~words
        bits = np.unpackbits(words.view(np.uint8), axis=1, count=n, bitorder="little")  # [R, n] uint8
        out = torch.from_numpy(bits).view(torch.bool)
    else:
        words = bitmask.pin_memory().to(device, non_blocking=True)  # staged: no wait for the device
        out = unpack_bitmask_torch(~words if invert else words, n)
    if n < vocab:
        out = torch.cat([out, out.new_full((R, vocab - n), invert)], dim=1)
    return out


def unpack_bitmask_torch(bitmask: torch.Tensor, n: int) -> torch.Tensor:
    """The device path of unpack_bitmask: int32 [R, W] -> bool [R, n], n <= 32 * W."""
    R, W = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(R, 32 * W)[:, :n].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """In place: rows `rows` of logits [B, V] keep only the tokens bitmask [len(rows), W] allows;
    the other rows are not touched (nothing is copied: one masked_fill_ per constrained row)."""
    banned = unpack_bitmask(bitmask, logits.shape[1], logits.device, invert=True)  # [R, V]
    if list(rows) == list(range(logits.shape[0])):
        logits.masked_fill_(banned, _NEG_INF)
        return
    for j, r in enumerate(rows):
        logits[r].masked_fill_(banned[j], _NEG_INF)


def top_k_mask(logits: torch.Tensor, k: torch.Tensor, kmax: int | None = None) -> torch.Tensor:
    """logits [B, V], k [B] int64 (<= 0 or >= V = off) -> logits with everything below the k-th
    largest set to -inf (ties with the k-th value are kept). `kmax`: the largest k that is on, known
    on the host (None: read back from k, a host sync)."""
    V = logits.shape[1]
    on = (k > 0) & (k < V)  # [B]
    if kmax is None:
        if not bool(on.any()):
            return logits
        kmax = int(torch.where(on, k, torch.ones_like(k)).max())
    kk = torch.where(on, k, torch.ones_like(k))  # [B]
    top = torch.topk(logits, kmax, dim=-1).values  # [B, kmax] descending
    kth = top.gather(1, (kk - 1).unsqueeze(1))  # [B, 1]
    kth = torch.where(on.unsqueeze(1), kth, torch.full_like(kth, _NEG_INF))
    return logits.masked_fill(logits < kth, _NEG_INF)


def top_p_mask(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], p [B] in (0, 1] -> logits outside the nucleus set to -inf. The nucleus is the
    shortest prefix of the stably descending-sorted distribution whose mass reaches p."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [B, V]
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [B, V] mass strictly before each token
    drop_sorted = before >= p.unsqueeze(1)  # [B, V]
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)  # [B, V]
    return logits.masked_fill(drop, _NEG_INF)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], min_p [B] -> tokens with p < min_p * max p set to -inf."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < thresh, _NEG_INF)


def _draw(probs: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF draw; one uniform per row from that row's generator. probs [B, V] -> [B]."""
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])  # [B] on the host
    if probs.is_cuda:
        u = u.pin_memory().to(probs.device, non_blocking=True)  # staged: no wait for the device
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    target = (u.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [B]
    idx = idx.clamp_(max=probs.shape[1] - 1)
    bad = probs.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0  # rounding at the very top of the CDF
    return torch.where(bad, probs.argmax(dim=-1), idx)


# With every sampled row's top_k at most this, the filters and the draw run over the top-k candidates
# ([S, kmax]) instead of the whole vocabulary ([S, V]: a stable sort of 262,144 probabilities per row).
CANDIDATE_LIMIT = 4096


def _filters(z: torch.Tensor, sp: Sequence[SamplingParams]) -> torch.Tensor:
    """top-k -> top-p -> min-p over logits z [S, N] (N = V, or candidates in ascending token order)."""
    N = z.shape[1]
    dev = z.device
    if any(0 < p.top_k < N for p in sp):
        kmax = max(p.top_k for p in sp if 0 < p.top_k < N)
        z = top_k_mask(z, to_device([p.top_k for p in sp], torch.long, dev), kmax)
    if any(p.top_p < 1.0 for p in sp):
        z = top_p_mask(z, to_device([p.top_p for p in sp], z.dtype, dev))
    if any(p.min_p > 0.0 for p in sp):
        z = min_p_mask(z, to_device([p.min_p for p in sp], z.dtype, dev))
    return z


def _sample_full(z: torch.Tensor, sp: Sequence[SamplingParams],
                 gens: Sequence[torch.Generator]) -> torch.Tensor:
    return _draw(torch.softmax(_filters(z, sp), dim=-1), gens)


def _sample_candidates(z: torch.Tensor, sp: Sequence[SamplingParams], kmax: int,
                       gens: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same draw as `_sample_full` when every row has 0 < top_k <= kmax: tokens outside a row's top
    k get probability 0 there, so only the kmax largest logits of each row can be drawn. They are put
    back in ascending token order (so the stable sort of top-p breaks ties by token id and the inverse
    CDF accumulates in token order, as over the whole vocabulary), filtered, and drawn from.
    Returns (tokens [S], tie [S] bool): tie marks a row whose smallest candidate is tied with tokens
    left out (top-k keeps every tie of the k-th value, so the candidates were not all of them); the
    caller reads the flags back with the tokens and redraws over the whole vocabulary if any is set."""
    vals, ids = torch.topk(z, kmax + 1, dim=-1)  # [S, kmax + 1] (kmax < V): the last is the first left out
    last, out = vals[:, kmax - 1], vals[:, kmax]  # [S]
    tie = (last == out) & torch.isfinite(last)  # -inf ties have probability 0 anyway
    vals, ids = vals[:, :kmax], ids[:, :kmax]
    ids, order = torch.sort(ids, dim=-1)  # [S, kmax] ascending token ids
    vals = vals.gather(1, order)
    probs = torch.softmax(_filters(vals, sp), dim=-1)  # [S, kmax]
    pick = _draw(probs, gens)  # [S] positions among the candidates
    return ids.gather(1, pick.unsqueeze(1)).squeeze(1), tie


def _read_back(t: torch.Tensor) -> list[list[float]]:
    """The step's one device -> host read: every result of the sampler packed in one float64 tensor
    (token ids < 2^53 are exact)."""
    return t.tolist()


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], grammar_rows: Sequence[int] = (),
           bitmask: torch.Tensor | None = None) -> SampleResult:
    """Sample one token per row of logits [B, V] (fp32, not modified). Rows `grammar_rows` are
    constrained by bitmask [len(grammar_rows), ceil(V / 32)] (engine/text/grammar.py).

    Nothing waits for the device but one read-back of the results (tokens, and logprobs when asked
    for): per-row parameters are staged through pinned memory, counts known on the host stay there."""
    B, V = logits.shape
    assert B == len(rows)
    dev = logits.device
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logp = None
    if lp_rows:
        raw_logp = torch.log_softmax(logits.index_select(0, to_device(lp_rows, torch.long, dev)), dim=-1)

    x = logits.clone()
    if bitmask is not None and grammar_rows:
        apply_token_bitmask(x, grammar_rows, bitmask)
    for i, r in enumerate(rows):
        if r.banned_ids:
            x[i, to_device(list(r.banned_ids), torch.long, dev)] = _NEG_INF
    if any(r.params.repetition_penalty != 1.0 or r.params.frequency_penalty != 0.0
           or r.params.presence_penalty != 0.0 or r.params.logit_bias for r in rows):
        apply_penalties(x, rows)

    out = x.argmax(dim=-1)  # [B] greedy for every row; sampled rows are replaced below
    tie = None
    samp = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if samp:
        idx = to_device(samp, torch.long, dev)
        sp = [rows[i].params for i in samp]
        temp = to_device([p.temperature for p in sp], x.dtype, dev)  # [S]
        z = x[idx] / temp.unsqueeze(1)  # [S, V]
        gens = []
        for i in samp:
            g = rows[i].generator
            assert g is not None, "a sampled row needs a generator"
            gens.append(g)
        kmax = max(p.top_k for p in sp)
        if all(0 < p.top_k < V for p in sp) and kmax <= CANDIDATE_LIMIT:
            states = [g.get_state() for g in gens]
            picked, tie = _sample_candidates(z, sp, kmax, gens)
        else:
            picked = _sample_full(z, sp, gens)
        out[idx] = picked

    kmax_lp = max((rows[i].params.logprobs or 0 for i in lp_rows), default=0)
    while True:
        cols = [out.to(torch.float64).unsqueeze(1)]  # [B, 1]
        c0 = 1 if tie is None else 2  # first logprob column
        if tie is not None:
            cols.append(tie.any().to(torch.float64).expand(B, 1))
        if raw_logp is not None:
            lp = torch.zeros(B, 1 + 2 * kmax_lp, dtype=torch.float64, device=dev)
            lp_idx = to_device(lp_rows, torch.long, dev)
            chosen = raw_logp.gather(1, out[lp_idx].unsqueeze(1))  # [L, 1]
            part = [chosen.double()]
            if kmax_lp > 0:
                top_v, top_i = torch.topk(raw_logp, min(kmax_lp, V), dim=-1)  # [L, k]
                part += [top_v.double(), top_i.double()]
            lp[lp_idx, : sum(t.shape[1] for t in part)] = torch.cat(part, dim=1)
            cols.append(lp)
        host = _read_back(torch.cat(cols, dim=1))  # [B, 1 (+ 1) (+ 1 + 2k)]
        if tie is None or not host[0][1]:
            break
        for g, st in zip(gens, states):  # a candidate set missed tied tokens: redraw over the vocabulary
            g.set_state(st)
        out[idx] = _sample_full(z, sp, gens)
        tie = None

    token_ids = [int(r[0]) for r in host]
    logprobs: list[TokenLogprob | None] = [None] * B
    for i in lp_rows:
        k = rows[i].params.logprobs or 0
        kk = min(kmax_lp, V)
        row = host[i][c0:]
        top = [(int(row[1 + kk + j]), row[1 + j]) for j in range(min(k, V))] if k > 0 else []
        logprobs[i] = TokenLogprob(token_ids[i], row[0], top)
    return SampleResult(token_ids, logprobs)


def sample_isolated(logits: torch.Tensor, rows: Sequence[SampleRow], grammar_rows: Sequence[int] = (),
                    bitmask: torch.Tensor | None = None) -> tuple[SampleResult, dict[int, Exception]]:
    """`sample`, with one row's failure confined to that row: when the batched call raises, each row is
    sampled alone; a row that still fails gets token -1 and its exception in the returned dict (the
    engine fails that request only). The other rows' tokens are those the batched call would give:
    every row draws from its own generator, and a row's masks depend on its own logits only."""
    states = [r.generator.get_state() if r.generator is not None else None for r in rows]
    try:
        return sample(logits, rows, grammar_rows, bitmask), {}
    except Exception as e:  # noqa: BLE001 - isolated below
        if len(rows) == 1:
            return SampleResult([-1], [None]), {0: e}
    for r, st in zip(rows, states):  # the failed batched call may have drawn already: undo it
        if r.generator is not None and st is not None:
            r.generator.set_state(st)
    token_ids: list[int] = []
    logprobs: list[TokenLogprob | None] = []
    failed: dict[int, Exception] = {}
    gpos = {row: j for j, row in enumerate(grammar_rows)}
    for i, r in enumerate(rows):
        try:
            if i in gpos and bitmask is not None:
                res = sample(logits[i:i + 1], [r], [0], bitmask[gpos[i]:gpos[i] + 1])
            else:
                res = sample(logits[i:i + 1], [r])
        except Exception as e:  # noqa: BLE001 - this row's own data is at fault
            failed[i] = e
            token_ids.append(-1)
            logprobs.append(None)
            continue
        token_ids.append(res.token_ids[0])
        logprobs.append(res.logprobs[0])
    return SampleResult(token_ids, logprobs), failed

