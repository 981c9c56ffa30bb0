"""Server configuration and the state shared by the routes (the engine, possibly still loading)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swaserve.engine.core import EngineUnavailable
from swaserve.server.errors import APIError
from swaserve.server.http.limits import DEFAULT_MAX_REQUEST_BYTES
from swaserve.server.media import MediaPolicy
from swaserve.server.metrics import Metrics
from swaserve.server.params import DEFAULT_MAX_STOP, merge_defaults
from swaserve.server.responses.store import DEFAULT_STORE_BYTES, DEFAULT_STORE_SIZE

if TYPE_CHECKING:
    # what the routes drive: the engine on a thread of this process, or in its own process
    from swaserve.engine.client.base import EngineClient
    from swaserve.engine.text.chat_template import ChatTemplate
    from swaserve.server.chat.images import VisionSetup

logger = logging.getLogger("swaserve.server")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None  # None = the engine's model_name
    served_model_aliases: tuple[str, ...] = ()  # further names clients may send (`--served-model-name A B`)
    api_key: str | None = None
    enable_cache_report: bool = False
    disconnect_poll_s: float = 0.25  # how often a non-streamed request checks for a gone client
    strict_requests: bool = False  # unknown request fields: 400 instead of a warning
    default_sampling: tuple[tuple[str, float], ...] = ()  # --default-sampling (over the GGUF's defaults)
    chat_template: str | None = None  # --chat-template: replaces (or supplies) the GGUF's template
    allowed_origins: tuple[str, ...] = ()  # CORS; empty = no CORS headers
    allowed_hosts: tuple[str, ...] = ()  # Host names admin POSTs may carry without a key, besides loopback
    max_stop_sequences: int = DEFAULT_MAX_STOP  # stop strings per request (OpenAI: 4)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies: 413 before parsing
    disable_docs: bool = False  # no /openapi.json
    ui: bool = False  # --ui: the inspector page at GET / (server/ui/route.py)
    more_api_keys: tuple[str, ...] = ()  # further keys accepted besides api_key (--api-key-file lines)
    responses_store_size: int = DEFAULT_STORE_SIZE  # stored /v1/responses (0: none kept)
    responses_store_bytes: int = DEFAULT_STORE_BYTES
    media: MediaPolicy = field(default_factory=MediaPolicy)  # image parts: sources and limits


_frozen = False


def freeze_startup_heap() -> None:
    """Move what is alive once the engine is up (torch, the model, the app: ~200k objects) out of the
    collector's reach (gc.freeze), once per process. A full collection otherwise walks all of them and
    holds the GIL ~100 ms on a loaded machine, and a request with 20,000 messages creates enough objects
    to start one: the HTTP loop (/health, streams) would wait that long."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


class ServerState:
    """Holds the engine once loaded; routes call .ready_engine() which raises 503 while loading."""

    def __init__(self, cfg: ServerConfig, engine: EngineClient | None,
                 loader: Callable[[], EngineClient] | None = None):
        self.cfg = cfg
        self.engine: EngineClient | None = engine
        self.loader = loader
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.on_loaded: Callable[[ChatTemplate | None], None] | None = None  # before /health turns 200
        self.metrics = Metrics(self.stats, lambda: self.model_name)
        self.created = int(time.time())
        self._template: ChatTemplate | None = None
        self._thread: threading.Thread | None = None
        self.owns_engine = engine is None
        self.draining = False  # set once by start_draining(); read by server/fleet/replica_api.py's gate
        if engine is not None:
            engine.log_requests = False  # the server writes the one INFO line per request

    # --- loading -------------------------------------------------------------------------------
    def start_loading(self) -> None:
        if self.engine is not None:
            freeze_startup_heap()
        if self.engine is not None or self.loader is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._load, name="swaserve-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        assert self.loader is not None
        try:
            t0 = time.perf_counter()
            engine = self.loader()
            engine.log_requests = False
            engine.start()
            freeze_startup_heap()  # before /health turns 200: its full collection holds the GIL 100+ ms
            if self.on_loaded is not None:  # `swaserve serve`: starts the chat worker processes
                try:
                    template = self._template_of(engine)
                except APIError:  # no chat template: the chat routes answer 400
                    template = None
                self.on_loaded(template)
            self.engine = engine
            logger.info("model %s ready in %.1f s (context %d tokens); serving as %r",
                        engine.model_name, time.perf_counter() - t0, engine.context_length, self.model_name)
            logger.info("sampling defaults for requests that set none: %s",
                        ", ".join(f"{k}={v}" for k, v in self.sampling_defaults().items()))
        except BaseException as e:  # reported by /health and by run_serve
            self.load_error = e
            logger.error("model load failed: %s", e)
            if self.on_load_error is not None:
                self.on_load_error(e)

    def start_draining(self) -> None:
        """Stop admitting work: from now on /health and every new API request answer 503 (a router sends
        them elsewhere); requests already admitted run to completion. One-way: the process is expected to
        exit once they are done."""
        if not self.draining:
            self.draining = True
            logger.info("draining: /health and new requests answer 503; requests in flight finish")

    def wait_loaded(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.engine is not None

    def shutdown(self) -> None:
        if self.owns_engine:  # `swaserve serve`: this process ends with its app
            from swaserve.server.off_loop import stop_processes

            stop_processes()
            if self.engine is not None:
                self.engine.close()  # AsyncEngine: also the core's KV tier sealed, joined

    # --- accessors -----------------------------------------------------------------------------
    def vision_setup(self) -> VisionSetup | None:
        """What chat planning needs to read image parts; None when the model has no image encoder."""
        spec = getattr(self.engine, "vision", None)
        if spec is None:
            return None
        from swaserve.server.chat.images import VisionSetup

        return VisionSetup(spec, self.cfg.media)

    def ready_engine(self) -> EngineClient:
        """The engine, if it can serve now; else a 503: loading, failed to load, or its process is being
        restarted (`engine_restarting`) or gone (`engine_dead`)."""
        if self.engine is not None:
            try:
                self.engine.check_available()
            except EngineUnavailable as e:
                raise APIError(503, str(e), None, e.code) from None
            return self.engine
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", None, "load_failed")
        raise APIError(503, "the model is still loading; retry shortly", None, "loading")

    @property
    def model_name(self) -> str:
        if self.cfg.served_model_name:
            return self.cfg.served_model_name
        return self.engine.model_name if self.engine is not None else "swaserve"

    def check_model(self, name: str | None) -> str:
        """The name to echo in responses; 404 for a model this server does not serve."""
        engine = self.ready_engine()
        if name is None or name in (self.model_name, engine.model_name, *self.cfg.served_model_aliases):
            return self.model_name if name is None or name == engine.model_name else name
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                       "model", "model_not_found")

    def chat_template(self) -> ChatTemplate:
        """--chat-template, else the GGUF's; 400 when there is neither."""
        return self._template_of(self.ready_engine())

    def _template_of(self, engine: EngineClient) -> ChatTemplate:
        if self.cfg.chat_template is not None:
            if self._template is None:
                from swaserve.engine.text.chat_template import build_chat_template

                self._template = build_chat_template(self.cfg.chat_template, engine.tokenizer,
                                                     engine.render_limits, "the --chat-template template")
            return self._template
        if engine.chat_template is None:
            raise APIError(400, "this model has no chat template (no tokenizer.chat_template in the GGUF); "
                           "start the server with --chat-template FILE", "messages", "no_chat_template")
        return engine.chat_template

    def sampling_defaults(self) -> dict[str, float]:
        """What a request that sets no sampling field gets (server/params.py)."""
        gguf = dict(self.engine.generation_defaults) if self.engine is not None else {}
        return merge_defaults(gguf, dict(self.cfg.default_sampling))

    def stats(self) -> dict[str, Any] | None:
        """The engine's stats; None while it loads or cannot serve (a dead engine's numbers are not
        reported as live)."""
        if self.engine is None:
            return None
        try:
            self.engine.check_available()
        except EngineUnavailable:
            return None
        return self.engine.stats()
