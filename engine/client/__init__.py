"""The engine's fronts: one engine loop (loop.py) behind the in-process AsyncEngine (in_process.py) and
the engine process (process.py), both an EngineClient (base.py), the interface the server drives."""

from swaserve.engine.client.base import EngineClient

__all__ = ["EngineClient"]
