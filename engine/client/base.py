"""What the server drives: `EngineClient`, the interface both fronts have (in_process.py's AsyncEngine,
process.py's EngineProcessClient), naming exactly what server/ uses. Importing this module does not
import torch."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from swaserve.engine.config import VisionSpec
    from swaserve.engine.core import ImageInput, RequestOutput, SamplingParams
    from swaserve.engine.text.chat_template import ChatTemplate
    from swaserve.engine.text.template_sandbox import RenderLimits
    from swaserve.engine.text.tokenizer import Tokenizer


class EngineClient(Protocol):
    """An engine the server can serve: a model's facts, requests in and outputs out, and its lifetime."""

    model_name: str
    context_length: int
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # the GGUF's (None without one)
    render_limits: RenderLimits  # the chat-template render budget, also for --chat-template
    generation_defaults: dict[str, float]  # the GGUF's general.sampling.* values, as SamplingParams fields
    log_requests: bool  # the core's one INFO line per request (the server writes its own)

    def start(self) -> None:
        """Start serving (idempotent)."""
        ...

    def check_available(self) -> None:
        """Raise EngineUnavailable (a 503 with its code) while the engine cannot serve: its process is
        being restarted, or is gone (engine/client/restart.py)."""
        ...

    def close(self) -> None:
        """Stop serving and release what the front owns (idempotent); for the one that built it."""
        ...

    vision: VisionSpec | None  # the image encoder's preprocessing, None: text only

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 anchors: Sequence[int] = (), images: Sequence[ImageInput] = ()
                 ) -> AsyncIterator[RequestOutput]:
        """Stream the RequestOutputs of every choice; RequestError / EngineOverloaded before any output;
        the request is aborted when the consumer stops reading."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort every choice of a request (thread-safe)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Engine.stats() as of the last step; `waiting` includes submissions not yet taken."""
        ...

    async def flush_cache(self) -> bool:
        """Drop every cached prefix between steps; False while requests run or wait."""
        ...

    async def cache_state(self, top_n: int = 64) -> dict[str, Any]:
        """The inspector's view of the cache (GET /v1/cache/state)."""
        ...
