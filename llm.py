"""Offline API: LLM(model_path, **engine_args).generate(prompts, params) and `swaserve generate`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from swaserve.engine.args import engine_config_from_kwargs
from swaserve.engine.config import EngineConfig
from swaserve.engine.core import FinishReason, ImageInput, SamplingParams, TokenLogprob


@dataclass
class Output:
    """One choice of one prompt."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None
    index: int = 0  # choice index (n > 1)
    matched_stop: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs: first None


class LLM:
    """Runs the engine synchronously in the calling thread (no server, no loop thread)."""

    def __init__(self, model_path: str | None = None, progress: bool = False,
                 config: EngineConfig | None = None, **engine_kwargs):
        from swaserve.engine.engine import Engine
        from swaserve.models.architectures import load_model

        cfg = config if config is not None else engine_config_from_kwargs(model_path, **engine_kwargs)
        self.engine = Engine(cfg, load_model(cfg, progress=progress))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def close(self) -> None:
        """Close the engine (Engine.close(): the KV tier's writes sealed, its thread joined, its memory
        freed); idempotent. generate() afterwards raises EngineClosed."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_bos=True)

    def chat_ids(self, messages: list[dict], **template_kwargs) -> tuple[list[int], list[int]]:
        """(token ids, message starts) of messages rendered with the model's chat template."""
        if self.engine.chat_template is None:
            raise ValueError("the model has no chat template (tokenizer.chat_template)")
        r = self.engine.chat_template.render(messages, add_generation_prompt=True, **template_kwargs)
        return list(r.token_ids), list(r.message_starts)

    def generate(self, prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 anchors: Sequence[Sequence[int]] | None = None,
                 images: Sequence[Sequence[ImageInput]] | None = None) -> list[Output]:
        """Outputs in prompt order (for n > 1, the choices of a prompt follow each other); `images`: each
        prompt's (engine/core.py ImageInput, spans over image token ids of the prompt)."""
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [self.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(plist)} sampling params")
        eng = self.engine
        rids = []
        for i, (p, sp) in enumerate(zip(ids, plist)):
            self._counter += 1
            rid = f"llm-{self._counter}"
            eng.add_request(rid, p, sp, anchors[i] if anchors is not None else (),
                            images[i] if images is not None else ())
            rids.append(rid)
        acc: dict[tuple[str, int], Output] = {}
        for rid, p, sp in zip(rids, ids, plist):
            for k in range(sp.n):
                acc[(rid, k)] = Output("", [], None, len(p), 0, [] if sp.logprobs is not None else None, k)
        while eng.has_unfinished():
            for o in eng.step():
                out = acc[(o.request_id, o.index)]
                out.text += o.text
                out.token_ids.extend(o.token_ids)
                out.cached_tokens = o.cached_tokens
                if o.logprobs and out.logprobs is not None:
                    out.logprobs.extend(o.logprobs)
                if o.prompt_logprobs is not None:
                    out.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    out.finish_reason = o.finish_reason
                    out.matched_stop = o.matched_stop
        return [acc[(rid, k)] for rid, sp in zip(rids, plist) for k in range(sp.n)]


# ---- `swaserve generate` ----------------------------------------------------------------------

def add_generate_args(p: argparse.ArgumentParser) -> None:
    """Flags of `swaserve generate` (the engine flags, --seed included, come from engine/args.py)."""
    g = p.add_argument_group("generation")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (BOS added; with --chat: the user message)")
    src.add_argument("--token-ids", help="prompt as comma-separated token ids, e.g. 2,105,4521")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--print-ids", action="store_true", help="also print the generated ids, comma-separated")
    g.add_argument("--chat", action="store_true",
                   help="wrap --prompt as a user message with the chat template")


def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--token-ids must be comma-separated integers, got {s!r}") from None
    if not ids:
        raise ValueError("--token-ids is empty")
    return ids


def run_generate(args: argparse.Namespace) -> int:
    """`swaserve generate`: prints the completion (and its ids with --print-ids)."""
    from swaserve.engine.args import engine_config_from_args

    cfg = engine_config_from_args(args)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs --prompt")
    prompt_ids = _parse_ids(args.token_ids) if args.token_ids is not None else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    params.validate(1 << 62)
    llm = LLM(config=cfg, progress=True)
    if prompt_ids is None:
        if args.chat:
            prompt_ids, _ = llm.chat_ids([{"role": "user", "content": args.prompt}])
        else:
            prompt_ids = llm.encode(args.prompt)
    try:
        (out,) = llm.generate([prompt_ids], params)
    finally:
        llm.close()
    print(out.text)
    if args.print_ids:
        print(",".join(str(t) for t in out.token_ids))
    print(f"[{out.prompt_tokens} prompt tokens, {len(out.token_ids)} generated, finish: {out.finish_reason}]",
          file=sys.stderr)
    return 0
