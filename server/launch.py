"""`swaserve serve`: flags, config validation before the model loads, uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
from typing import TYPE_CHECKING

from swaserve.server.app import build_app
from swaserve.server.state import ServerConfig

if TYPE_CHECKING:
    from swaserve.engine.config import EngineConfig
    from swaserve.engine.engine import Engine

logger = logging.getLogger("swaserve.server")


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
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the GGUF file stem, or swaserve-demo)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on the API routes")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (0 included) in every usage object")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    g.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   help="run the engine on a thread of the server's process instead of its own process "
                        "(debugging; the engine then gets all cores but one by default)")


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


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty")
    return ServerConfig(served_model_name=args.served_model_name, api_key=args.api_key,
                        enable_cache_report=args.enable_cache_report)


def build_engine_core(cfg: EngineConfig) -> Engine:
    """Load the model and build the synchronous engine (in the engine process, or on a server thread)."""
    from swaserve.engine.engine import Engine
    from swaserve.models.registry import load_model

    return Engine(cfg, load_model(cfg, progress=True))


def run_serve(args: argparse.Namespace) -> int:
    """Validate every flag, then serve at once while the model loads in a background thread."""
    import uvicorn

    from swaserve.engine.args import engine_config_from_args

    engine_cfg = engine_config_from_args(args)  # ValueError: one line from cli.py, nothing loaded
    if engine_cfg.cpu_threads is None and not args.engine_process:
        # In one process, leave a core to the HTTP event loop: an OpenMP team that shares its cores with
        # another busy thread of its process stalls at every barrier (measured: 13.5k-token prefill 4.9 s
        # with 1 thread on 2 cores, 23-35 s with 2). In its own process the engine takes every core.
        engine_cfg = dataclasses.replace(engine_cfg, cpu_threads=max(1, (os.cpu_count() or 1) - 1))
    server_cfg = server_config_from_args(args)
    _check_bind(args.host, args.port)

    def load():
        if args.engine_process:
            from swaserve.engine.engine_process import EngineClient

            return EngineClient(build_engine_core, engine_cfg)
        from swaserve.engine.async_engine import AsyncEngine

        return AsyncEngine(build_engine_core(engine_cfg))

    app = build_app(load, server_cfg)
    state = app.state.swa
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                            access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def on_load_error(e: BaseException) -> None:
        server.should_exit = True

    state.on_load_error = on_load_error
    logger.info("swaserve listening on http://%s:%d (model loading in the background; /health is 503 until "
                "ready)", args.host, args.port)
    server.run()
    if state.load_error is not None:
        if isinstance(state.load_error, ValueError):
            raise state.load_error  # printed as one line by cli.py
        raise RuntimeError(f"model load failed: {state.load_error}") from state.load_error
    return 0
