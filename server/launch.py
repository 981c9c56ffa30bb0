"""`swaserve serve`: flags, config validation before the model loads, uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import socket
from typing import TYPE_CHECKING

from swaserve.engine.args import bounded_number
from swaserve.engine.core import MAX_STOP_STRINGS
from swaserve.server.app import build_app
from swaserve.server.http.connections import DEFAULT_READ_TIMEOUT, ConnectionPolicy, default_max_connections
from swaserve.server.http.limits import DEFAULT_MAX_REQUEST_BYTES
from swaserve.server.media import MediaPolicy
from swaserve.server.params import DEFAULT_MAX_STOP, parse_default_sampling
from swaserve.server.responses.store import DEFAULT_STORE_BYTES, DEFAULT_STORE_SIZE
from swaserve.server.state import ServerConfig

if TYPE_CHECKING:
    from swaserve.engine.config import EngineConfig
    from swaserve.engine.engine import Engine

logger = logging.getLogger("swaserve.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds running requests get after SIGTERM (server/http/shutdown.py)


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer, got {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in [0, 65535], got {v}")
    return v


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=1919, help="port (default 1919)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; the first is echoed in responses (default: the GGUF file "
                        "stem, or swaserve-demo)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template replacing (or supplying) the GGUF's tokenizer.chat_template")
    g.add_argument("--default-sampling", default=None, metavar="KEY=VALUE,...",
                   help="sampling defaults for requests that do not set them, over the GGUF's and Gemma 4's "
                        "(e.g. temperature=0.7,top_k=20; also a JSON object)")
    g.add_argument("--override-generation-config", dest="default_sampling", default=argparse.SUPPRESS,
                   metavar="JSON", help="vLLM spelling of --default-sampling")
    g.add_argument("--strict-requests", action="store_true",
                   help="answer 400 to unknown request fields (default: ignore them with a warning)")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="CORS: origins allowed to call the API from a browser ('*': any; default: no CORS)")
    g.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="without an API key, Host names (besides loopback and --host) that may POST to the "
                        "admin routes /flush_cache and /reset_prefix_cache; * = any (default: none)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on every route but /health and /metrics "
                        "(visible in `ps`: prefer --api-key-file or SWASERVE_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (its first line; further non-empty lines are more keys, "
                        "each accepted, each with its own stored responses)")
    g.add_argument("--max-request-bytes", type=bounded_number("--max-request-bytes", int, min=1024),
                   default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies get 413 before parsing (default {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--max-stop-sequences", type=bounded_number("--max-stop-sequences", int, min=1,
                                                               max=MAX_STOP_STRINGS),
                   default=DEFAULT_MAX_STOP, help=f"stop strings per request (default {DEFAULT_MAX_STOP}, "
                                                  "as OpenAI)")
    g.add_argument("--disable-docs", action="store_true", help="serve no /openapi.json")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image parts may name http(s) URLs on these hosts (and their subdomains); the server "
                        "fetches them (default: none, only data: URLs)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image parts may name file:// URLs of files under DIR (default: none)")
    g.add_argument("--max-image-bytes", type=bounded_number("--max-image-bytes", int, min=1024),
                   default=MediaPolicy.max_image_bytes, help="encoded bytes per image (default 20 MiB)")
    g.add_argument("--max-image-pixels", type=bounded_number("--max-image-pixels", int, min=1),
                   default=MediaPolicy.max_image_pixels, help="width x height per image (default 40,000,000)")
    g.add_argument("--max-images-per-request", type=bounded_number("--max-images-per-request", int, min=0),
                   default=MediaPolicy.max_images, help="image parts per request (default 16)")
    g.add_argument("--worker-processes", type=bounded_number("--worker-processes", int, min=1, max=64),
                   default=None, metavar="N",
                   help="processes that render chat templates, tokenize long prompts and parse large bodies "
                        "(default: half the usable cores, 2 to 8; with N >= 2 a large body holds at most "
                        "N - 1)")
    g.add_argument("--max-connections", type=bounded_number("--max-connections", int, min=1), default=None,
                   metavar="N", help="open connections beyond N get a 503 and are closed at once (default: "
                   "below the open-file limit, at most 4096)")
    g.add_argument("--request-read-timeout", type=bounded_number("--request-read-timeout", float, min=0),
                   default=DEFAULT_READ_TIMEOUT, metavar="S",
                   help="seconds a client has to send a whole request, from its connection or its previous "
                        f"response; 0 = no limit (default {DEFAULT_READ_TIMEOUT:g})")
    g.add_argument("--shutdown-timeout", type=bounded_number("--shutdown-timeout", float, min=0),
                   default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="on SIGTERM, seconds running requests get to finish before they end with a 503 "
                        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g}); new requests get 503 at once; exit code 0")
    g.add_argument("--responses-store-size", type=bounded_number("--responses-store-size", int, min=0),
                   default=DEFAULT_STORE_SIZE, metavar="N",
                   help="/v1/responses made with store (the default) kept for previous_response_id and GET, "
                        f"least recently used out; 0 keeps none (default {DEFAULT_STORE_SIZE})")
    g.add_argument("--responses-store-bytes", type=bounded_number("--responses-store-bytes", int, min=0),
                   default=DEFAULT_STORE_BYTES, metavar="BYTES",
                   help=f"the stored responses' bound in bytes of JSON (default {DEFAULT_STORE_BYTES})")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (0 included) in every usage object")
    g.add_argument("--ui", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the cache inspector page at / (chat + cache view; default: on when --host is "
                        "a loopback address, off otherwise)")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    g.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="run the engine on a thread of the server's process instead of its own process "
                        "(debugging; the engine then gets all cores but one by default)")
    from swaserve.engine.client.restart import add_restart_args

    add_restart_args(p)  # --engine-restarts, --engine-heartbeat-timeout, --engine-stall-timeout
    v = p.add_argument_group("vLLM spellings (aliases)")
    v.add_argument("--max-model-len", dest="context_length", default=argparse.SUPPRESS,
                   type=bounded_number("--max-model-len", int, min=1), help="= --context-length")
    v.add_argument("--gpu-memory-utilization", dest="kv_memory_fraction", default=argparse.SUPPRESS,
                   type=bounded_number("--gpu-memory-utilization", float, min=0, max=1, min_exclusive=True),
                   help="= --kv-memory-fraction (the share of the memory left after the weights)")
    v.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None,
                   help="= --cache-type radix")
    v.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="= --cache-type naive")


def apply_aliases(args: argparse.Namespace) -> None:
    """Fold the vLLM spellings that are not plain argparse aliases into the engine flags."""
    enable = getattr(args, "enable_prefix_caching", None)
    if enable is not None:
        args.cache_type = "radix" if enable else "naive"


def _check_bind(host: str, port: int) -> None:
    """Fail fast (before loading the model) when the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def _origins(values: list[str] | None) -> tuple[str, ...]:
    out: list[str] = []
    for v in values or []:
        v = v.strip()
        if v.startswith("["):  # vLLM passes a JSON list
            try:
                items = json.loads(v)
            except json.JSONDecodeError:
                raise ValueError(f"--allowed-origins: not a JSON list: {v}") from None
            out.extend(str(x) for x in items)
        else:
            out.extend(x.strip() for x in v.split(",") if x.strip())
    return tuple(out)


def _allowed_hosts(values: list[str] | None, bind: str) -> tuple[str, ...]:
    """--allowed-hosts, plus the --host address when it names one host (not 0.0.0.0 / ::)."""
    hosts = [v.strip() for v in values or [] if v.strip()]
    if bind not in ("0.0.0.0", "::", ""):
        hosts.append(bind)
    return tuple(dict.fromkeys(hosts))


def _chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"--chat-template {path}: no such file")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    from swaserve.engine.text.chat_template import make_environment

    try:
        make_environment().from_string(source)
    except Exception as e:  # a jinja syntax error: one line, before the model loads
        raise ValueError(f"--chat-template {path}: {e}") from None
    if not source.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return source


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file's first line, else $SWASERVE_API_KEY; ValueError when empty."""
    return (api_keys_from_args(args) or (None,))[0]


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Every key accepted: api_key_from_args's first, then --api-key-file's further non-empty lines."""
    more: list[str] = []
    key = args.api_key
    if key is not None and not key.strip():
        raise ValueError("--api-key must not be empty")
    path = getattr(args, "api_key_file", None)
    if key is None and path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
                more = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {path}: the first line is empty")
    if key is None:
        env = os.environ.get("SWASERVE_API_KEY")
        if env is not None:
            key = env.strip()
            if not key:
                raise ValueError("SWASERVE_API_KEY is set but empty")
    return () if key is None else tuple(dict.fromkeys([key, *more]))


def _media_policy(args: argparse.Namespace) -> MediaPolicy:
    local = getattr(args, "allowed_local_media_path", None)
    if local is not None and not os.path.isdir(local):
        raise ValueError(f"--allowed-local-media-path {local}: not a directory")
    return MediaPolicy(max_image_bytes=getattr(args, "max_image_bytes", MediaPolicy.max_image_bytes),
                       max_image_pixels=getattr(args, "max_image_pixels", MediaPolicy.max_image_pixels),
                       max_images=getattr(args, "max_images_per_request", MediaPolicy.max_images),
                       allowed_domains=tuple(d.lower() for d in getattr(args, "allowed_media_domains", None)
                                             or ()),
                       local_media_dir=os.path.realpath(local) if local else None)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    keys = api_keys_from_args(args)
    names = list(args.served_model_name or [])
    if any(not n.strip() for n in names):
        raise ValueError("--served-model-name must not be empty")
    defaults = parse_default_sampling(getattr(args, "default_sampling", None))
    return ServerConfig(served_model_name=names[0] if names else None, served_model_aliases=tuple(names[1:]),
                        api_key=keys[0] if keys else None, more_api_keys=keys[1:],
                        responses_store_size=getattr(args, "responses_store_size", DEFAULT_STORE_SIZE),
                        responses_store_bytes=getattr(args, "responses_store_bytes", DEFAULT_STORE_BYTES),
                        enable_cache_report=args.enable_cache_report,
                        strict_requests=args.strict_requests, default_sampling=tuple(defaults.items()),
                        chat_template=_chat_template(args.chat_template),
                        allowed_origins=_origins(args.allowed_origins),
                        allowed_hosts=_allowed_hosts(getattr(args, "allowed_hosts", None), args.host),
                        max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
                        max_stop_sequences=getattr(args, "max_stop_sequences", DEFAULT_MAX_STOP),
                        disable_docs=getattr(args, "disable_docs", False),
                        media=_media_policy(args),
                        ui=args.ui if getattr(args, "ui", None) is not None else is_loopback(args.host))


def build_engine_core(cfg: EngineConfig) -> Engine:
    """Load the model and build the synchronous engine (in the engine process, or on a server thread)."""
    from swaserve.engine.engine import Engine
    from swaserve.models.architectures import load_model

    return Engine(cfg, load_model(cfg, progress=True))


def run_serve(args: argparse.Namespace) -> int:
    """Validate every flag, then serve at once while the model loads in a background thread."""
    import uvicorn

    from swaserve.engine.args import engine_config_from_args

    apply_aliases(args)
    engine_cfg = engine_config_from_args(args)  # ValueError: one line from cli.py, nothing loaded
    if engine_cfg.cpu_threads is None and not args.engine_process:
        # In one process, leave a core to the HTTP event loop: an OpenMP team that shares its cores with
        # another busy thread of its process stalls at every barrier (measured: 13.5k-token prefill 4.9 s
        # with 1 thread on 2 cores, 23-35 s with 2). In its own process the engine takes every core.
        engine_cfg = dataclasses.replace(engine_cfg, cpu_threads=max(1, (os.cpu_count() or 1) - 1))
    elif engine_cfg.cpu_threads is None:
        # in its own process: every core, or as many as other processes leave free (a 2-thread team beside
        # one busy process decodes at half the speed of 1 thread; docs/benchmarks.md)
        engine_cfg = dataclasses.replace(engine_cfg, cpu_threads_follow_load=True)
    server_cfg = server_config_from_args(args)
    _check_bind(args.host, args.port)

    engine_failure: list[str] = []  # the engine process failed past --engine-restarts: exit non-zero

    def on_engine_failure(message: str) -> None:
        engine_failure.append(message)
        server.should_exit = True

    def load():
        if args.engine_process:
            from swaserve.engine.client.process import EngineProcessClient
            from swaserve.engine.client.restart import restart_policy_from_args

            return EngineProcessClient(build_engine_core, engine_cfg, policy=restart_policy_from_args(args),
                                       on_fatal=on_engine_failure)
        from swaserve.engine.client.in_process import AsyncEngine

        return AsyncEngine(build_engine_core(engine_cfg))

    app = build_app(load, server_cfg)
    state = app.state.swa
    policy = ConnectionPolicy(args.max_connections or default_max_connections(), args.request_read_timeout)
    from swaserve.server.http.shutdown import FLUSH_S, GracefulServer

    # uvicorn's own graceful stop only starts after the drain (its timeout covers the final writes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                            access_log=False, timeout_graceful_shutdown=int(FLUSH_S), http=policy.protocol())
    # SIGTERM / SIGINT drain (server/http/shutdown.py)
    server = GracefulServer(config, state, args.shutdown_timeout, app.state.swa_requests)

    def on_load_error(e: BaseException) -> None:
        server.should_exit = True

    state.on_load_error = on_load_error
    from swaserve.server.chat.worker import start_workers
    from swaserve.server.off_loop import configure_processes

    configure_processes(getattr(args, "worker_processes", None))

    state.on_loaded = start_workers  # chat rendering's worker processes, before the first request
    logger.info("swaserve listening on http://%s:%d (model loading in the background; /health is 503 until "
                "ready)", args.host, args.port)
    server.run()
    if state.load_error is not None:
        if isinstance(state.load_error, ValueError):
            raise state.load_error  # printed as one line by cli.py
        raise RuntimeError(f"model load failed: {state.load_error}") from state.load_error
    if engine_failure:
        logger.error("exiting with code 1: %s", engine_failure[0])
        return 1
    return 0
