"""Core request state shared by the engine, the scheduler and the server."""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from swaserve.engine.kvcache.base import CacheHandle

FinishReason = Literal["stop", "length", "abort"]

# Hard bounds every request is checked against (SamplingParams.validate), whatever the front end: a
# value past them could overflow a batched tensor or cost every other request time. The server's
# own limits (--max-stop-sequences, OpenAI's 4 by default) sit inside these.
MAX_INT = (1 << 31) - 1  # token counts
MAX_STOP_STRINGS = 1024  # stop strings, and stop token ids, per request
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_CHARS = 4096  # characters summed over a request's stop strings (the stop automaton's size)
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI documents 300 tokens)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20  # top alternatives per token, of the output (logprobs) and of the prompt (prompt_logprobs)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (the server answers 503)."""


class EngineClosed(RuntimeError):
    """The engine was closed (Engine.close()): it takes no more requests (the server answers 503)."""


class EngineUnavailable(RuntimeError):
    """The engine cannot serve now: its process died or froze and is being restarted (`code`
    "engine_restarting"), or it is gone for good ("engine_dead"); the server answers 503 with `code`."""

    def __init__(self, message: str, code: str = "engine_restarting"):
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[object, ...]:
        return (EngineUnavailable, (str(self), self.code))


class RequestFailed(RuntimeError):
    """One request failed while being served (the others go on); the server answers 500 with its id."""


class GrammarFailed(RequestFailed):
    """A request's grammar failed during generation (a matcher error, e.g. an llguidance resource limit):
    that request ends with this error (the server answers 400, or an error event in a stream)."""


class RequestError(ValueError):
    """Bad request input the engine detects (e.g. prompt longer than the context); HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


GrammarKind = Literal["json_schema", "lark", "regex"]


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint as plain, picklable data; the engine compiles it
    (engine/text/grammar.py).

    kind "json_schema": `source` is a JSON schema as JSON text; "lark": an llguidance Lark grammar
    (special tokens written `<|"|>`, JSON sub-grammars as `%json {...}`); "regex": a regular expression.
    """

    kind: GrammarKind
    source: str


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the context length; 0 = only prefill the prompt (no token)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token's logprob plus top-k
    # None = off; k >= 0 = each prompt token's logprob and rank plus the top-k, computed in the prefill
    # (engine/runner/prompt_logprobs.py; the first token has none). The prompt is then not reused from the
    # prefix cache (docs/cache.md), only inserted into it.
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1
    skip_special_tokens: bool = True
    # with skip_special_tokens=False: special tokens decode to MARK_OPEN + text + MARK_CLOSE
    # (engine/text/tokenizer.py), so that a reader tells them from the same text written out
    mark_special_tokens: bool = False
    min_tokens: int = 0  # stop ids (EOS, stop_token_ids) are banned until this many tokens were generated
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    grammar: GrammarSpec | None = None  # constrain the output (structured output, forced tool calls)

    def validate(self, vocab_size: int) -> None:
        """Raise RequestError naming the field for out-of-range values."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be a finite number", name)
        if self.max_tokens is not None and self.max_tokens < 0:
            raise RequestError("max_tokens must be at least 0", "max_tokens")
        if self.max_tokens is not None and self.max_tokens > MAX_INT:  # no context is that long
            raise RequestError(f"max_tokens is too large: {self.max_tokens} (at most {MAX_INT}; the prompt "
                               "and max_tokens must fit the model's context length)", "max_tokens")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise RequestError("seed must fit in 64 bits", "seed")
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestError("temperature must be in [0, 2]", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p must be in (0, 1]", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError("top_k must be -1 (off) or at least 1", "top_k")
        if self.top_k > vocab_size:
            raise RequestError(f"top_k must not exceed the vocabulary size ({vocab_size})", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError("min_p must be in [0, 1]", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2]", name)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
                               "repetition_penalty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        if not 1 <= self.n <= 16:
            raise RequestError("n must be in [1, 16]", "n")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        for tid, bias in self.logit_bias:
            if not 0 <= tid < vocab_size:
                raise RequestError(f"logit_bias token id {tid} is outside the vocabulary", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise RequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise RequestError(f"each stop string must be at most {MAX_STOP_LENGTH} characters", "stop")
        total = sum(len(s) for s in self.stop)
        if total > MAX_STOP_CHARS:
            raise RequestError(f"stop strings must total at most {MAX_STOP_CHARS} characters, got {total}",
                               "stop")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise RequestError(f"stop_token_ids takes at most {MAX_STOP_STRINGS} ids", "stop_token_ids")
        for tid in self.stop_token_ids:
            if not 0 <= tid < vocab_size:
                raise RequestError(f"stop token id {tid} is outside the vocabulary", "stop_token_ids")
        if self.min_tokens < 0:
            raise RequestError("min_tokens must be >= 0", "min_tokens")
        if self.min_tokens > MAX_INT:
            raise RequestError(f"min_tokens is too large: {self.min_tokens} (at most {MAX_INT}; no more than "
                               "the context length leaves for the completion)", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                               f"({self.max_tokens})", "min_tokens")
        if self.grammar is not None and self.ignore_eos:
            raise RequestError("ignore_eos cannot be combined with a grammar (structured output or a "
                               "required tool call ends with EOS)", "ignore_eos")


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its soft tokens fill prompt positions [offset, offset + length), where the
    prompt holds the image token id; the engine keys them in the prefix cache by `key` (image_pad_ids)."""

    offset: int
    length: int  # soft tokens: the encoder's output rows
    key: int  # 64-bit content hash of the prepared pixels (models/gemma4_image.py content_hash)
    pixel_values: Any  # np.float32 [patches, 3 * patch_size**2]
    position_ids: Any  # np.int64 [patches, 2]


PAD_ID_SPAN = 1 << 40  # image pad ids lie in [vocab, vocab + PAD_ID_SPAN): never a real token


def image_pad_ids(key: int, length: int, vocab: int) -> list[int]:
    """The ids an image's soft tokens carry in Req.token_ids (the prefix cache's key), all >= vocab: a
    different value per position from a hash of (key, position), so that two different images share no
    prefix of their spans (SGLang and vLLM key an image the same way, by a hash of its content)."""
    seed = (key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")  # content_hash is signed
    out = []
    for i in range(0, length, 4):  # one sha256 gives four 64-bit draws
        d = hashlib.sha256(seed + i.to_bytes(4, "little")).digest()
        out.extend(vocab + int.from_bytes(d[j:j + 8], "little") % PAD_ID_SPAN for j in range(0, 32, 8))
    return out[:length]


def image_blocks(images: Sequence[ImageInput]) -> tuple[tuple[int, int], ...]:
    """The [start, end) prompt spans whose tokens attend to each other on the sliding layers when image
    attention is bidirectional: one per run of soft tokens (touching images merge, as transformers groups
    consecutive image tokens of mm_token_type_ids into one block; begin / end tokens are text)."""
    out: list[tuple[int, int]] = []
    for im in images:
        if out and out[-1][1] == im.offset:
            out[-1] = (out[-1][0], im.offset + im.length)
        elif im.length > 0:
            out.append((im.offset, im.offset + im.length))
    return tuple(out)


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # prompt logprobs: tokens at least as likely, itself included (1 = the top)


@dataclass
class RequestOutput:
    """One incremental update for one choice of one request (engine -> server)."""

    request_id: str
    index: int  # choice index (n > 1)
    text: str  # new text since the previous update (stop strings already held back / cut)
    token_ids: list[int]  # new token ids since the previous update
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (exact)
    completion_tokens: int  # total so far for this choice
    matched_stop: str | int | None = None
    error: str | None = None  # set on the last output of a choice that failed (its own data was at fault)
    # params.prompt_logprobs: one entry per prompt token, the first None; on the choice's first output only
    prompt_logprobs: list[TokenLogprob | None] | None = None


Phase = Literal["prefill", "decode", "mixed"]


@dataclass(eq=False)
class Req:
    """One choice of one request, as the scheduler sees it. Token ids are prompt + output so far."""

    rid: str  # unique: "<request_id>" or "<request_id>#<index>" for n > 1
    request_id: str
    index: int
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    anchors: tuple[int, ...] = ()
    images: tuple[ImageInput, ...] = ()  # ordered, disjoint spans; their token ids are image_pad_ids
    # bidirectional image attention (image_blocks of `images`; empty: causal everywhere): the spans whose
    # tokens see each other on the sliding layers. A prefill chunk never ends strictly inside one
    # (chunk_end), so each span's uncomputed tokens are computed in one chunk.
    attn_blocks: tuple[tuple[int, int], ...] = ()
    max_len: int = 0  # token_ids may grow to this length (prompt + max_tokens, within the context)
    stop_ids: frozenset[int] = frozenset()  # eos ids (unless ignore_eos) + params.stop_token_ids
    seed: int = 0  # generator seed (params.seed, or derived from the engine seed)
    arrival_seq: int = 0  # submission order; the newest running request is preempted first
    parent: Req | None = None  # n > 1: admitted once this choice's prompt is in the cache
    status: ReqStatus = ReqStatus.WAITING
    # KV state (scheduler/kv_manager.py). token_ids[:num_computed] have KV in the pools; page i of
    # full_pages / swa_pages holds positions [i * page_size, (i + 1) * page_size). Pages
    # [0, tree_len / page_size) belong to the prefix cache (kept alive by the lock on `handle`),
    # later ones to this request.
    num_computed: int = 0
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int | None] = field(default_factory=list)  # None: SWA KV dropped (out of window)
    tree_len: int = 0
    handle: CacheHandle | None = None
    swa_drop_from: int = 0  # request-owned SWA pages before this page index are already dropped
    prompt_cached: bool = False  # the whole prompt was inserted into the cache once
    cached_tokens: int | None = None  # prompt tokens reused at first admission (exact)
    offload_cached: int = 0  # of those, tokens promoted from the second KV tier (engine/kvcache/tier/)
    num_preemptions: int = 0
    deferred_at: int | None = None  # scheduler step it first waited for cold pages (scheduler/admission.py)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    generator: object | None = None  # filled by the model runner (torch.Generator)
    # grammar matcher state (engine/text/grammar.py GrammarState), made by the model runner at the first
    # sample; it follows output_ids (so preemption and re-prefill leave it valid); dropped at finish
    grammar: object | None = None
    # params.prompt_logprobs: entry i is prompt token i + 1's (from the row of position i), appended by the
    # engine as the prefill chunks run; handed out once, with the choice's first output
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # timings (time.monotonic), filled by the engine
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED

    @property
    def prompt_rows_needed(self) -> bool:
        """Whether prompt logprob rows are still to be computed (row i of the prefill gives token i + 1's)."""
        return (self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) < self.prompt_len - 1)

    @property
    def reuse_limit(self) -> int | None:
        """The most tokens admission may reuse from the prefix cache: a request computing prompt logprobs
        runs every row it has no logprob of yet (None = no limit)."""
        return len(self.prompt_logprobs) if self.prompt_rows_needed else None

    def chunk_end(self, start: int, end: int) -> int:
        """The end of a prefill chunk [start, end) moved off any attn_block it would split: back to the
        block's start when the chunk begins before it, else on to the block's end (past the step's budget:
        an image is computed in one chunk, so a chunk may exceed --chunked-prefill-size by one image)."""
        for lo, hi in self.attn_blocks:
            if lo < end < hi:
                return lo if start < lo else hi
        return end

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs (first token None) for the choice's first output, once all are in; None
        otherwise (not asked, handed out already, or the request ended before its prefill did)."""
        if self.params.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        if len(self.prompt_logprobs) < self.prompt_len - 1:
            return None
        out: list[TokenLogprob | None] = [None, *self.prompt_logprobs]
        self.prompt_logprobs_sent = True
        self.prompt_logprobs = []
        return out


@dataclass
class Batch:
    """One model step: sequence b feeds token_ids[prefix_lens[b] : prefix_lens[b] + q_lens[b]]."""

    reqs: list[Req]
    q_lens: list[int]
    prefix_lens: list[int]
    sample: list[bool]  # True where the chunk reaches the end of token_ids: sample the next token

    @property
    def phase(self) -> Phase:
        dec = [p + q == len(r.token_ids) and q == 1
               for r, p, q in zip(self.reqs, self.prefix_lens, self.q_lens)]
        return "decode" if all(dec) else "prefill" if not any(dec) else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def prefill_tokens(self) -> int:
        """Tokens of the step's prefill chunks (sequences of more than one token; decodes excluded)."""
        return sum(q for q in self.q_lens if q > 1)

    def input_ids(self) -> list[int]:
        out: list[int] = []
        for r, p, q in zip(self.reqs, self.prefix_lens, self.q_lens):
            out.extend(r.token_ids[p:p + q])
        return out
