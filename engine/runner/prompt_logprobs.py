"""Prompt logprobs (SamplingParams.prompt_logprobs: vLLM's `prompt_logprobs`, completions' echo + logprobs),
computed in the prefill that runs anyway: no second pass.

The row of position i predicts token i + 1, so a request asking for them needs the rows of positions
[0, prompt_len - 1) once each; the engine appends each step's results to `Req.prompt_logprobs` and the
scheduler's admission reuses no cached position past them (Req.reuse_limit). Per step, the rows of every
chunk that still needs some are gathered from the step's final hidden states and the LM head runs over at
most `max_rows` of them at a time: logits [S, V] -> log-softmax -> each row's own-token logprob and rank
and its top-k, copied to the host. The [S, V] tensors are gone before the next slice, so the
all-vocabulary memory is that of S rows whatever the prompt's or the chunk's length (the builder sets S to
the rows a full sampling step takes, which the peak-step reservation covers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.engine.core import Batch, Req, TokenLogprob
from swaserve.engine.model_api import CausalLM
from swaserve.engine.runner.staging import to_device


@dataclass(frozen=True)
class PromptRows:
    """The prompt logprob rows one chunk of a step provides: positions [start, end) of `req`, which are
    rows [row, row + end - start) of the step's hidden states."""

    req: Req
    start: int
    end: int
    row: int


def plan_rows(batch: Batch) -> list[PromptRows]:
    """The chunks of `batch` that give prompt logprob rows still missing (none on a decode-only step)."""
    out: list[PromptRows] = []
    row = 0
    for r, p, q in zip(batch.reqs, batch.prefix_lens, batch.q_lens):
        if r.prompt_rows_needed:
            done = len(r.prompt_logprobs)
            if p > done:  # admission reuses no position past `done` (Req.reuse_limit): a gap is a bug
                raise RuntimeError(f"{r.rid}: chunk starts at {p} but prompt logprobs end at {done}")
            end = min(p + q, r.prompt_len - 1)
            if done < end:
                out.append(PromptRows(r, done, end, row + done - p))
        row += q
    return out


@torch.no_grad()
def compute(model: CausalLM, hidden: torch.Tensor, plan: list[PromptRows],
            max_rows: int) -> dict[Req, list[TokenLogprob]]:
    """Each planned row's logprob of its next prompt token, that token's rank and the request's top-k,
    from hidden [T, H]; the LM head runs over at most max_rows rows at a time."""
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    for pr in plan:
        n = pr.end - pr.start
        rows.extend(range(pr.row, pr.row + n))
        targets.extend(pr.req.token_ids[pr.start + 1:pr.end + 1])
        ks.extend([pr.req.params.prompt_logprobs or 0] * n)
    rows_t = to_device(rows, torch.int64, hidden.device)  # [R]
    targets_t = to_device(targets, torch.int64, hidden.device)  # [R]
    kmax = max(ks)
    own: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    step = max(1, max_rows)
    for s in range(0, len(rows), step):
        logits = model.logits(hidden[rows_t[s:s + step]])  # [S, V] fp32
        lsm = torch.log_softmax(logits, dim=-1)  # [S, V]
        del logits
        tgt = targets_t[s:s + step, None]  # [S, 1]
        own_t = lsm.gather(1, tgt)  # [S, 1]
        rank_t = (lsm >= own_t).sum(dim=-1)  # [S] as vLLM: tokens at least as likely, itself included
        if kmax > 0:
            tv, ti = lsm.topk(kmax, dim=-1)  # [S, kmax], best first
            top_lps.extend(tv.tolist())
            top_ids.extend(ti.tolist())
        own.extend(own_t[:, 0].tolist())
        ranks.extend(rank_t.tolist())
        del lsm
    out: dict[Req, list[TokenLogprob]] = {}
    i = 0
    for pr in plan:
        lps = out.setdefault(pr.req, [])
        for _ in range(pr.end - pr.start):
            k = ks[i]
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k > 0 else []
            lps.append(TokenLogprob(targets[i], own[i], top, ranks[i]))
            i += 1
    return out
