"""Continuous batching scheduler (pure Python, no torch)."""

from swaserve.engine.scheduler.kv_manager import KVManager
from swaserve.engine.scheduler.requests import check_lengths, make_reqs
from swaserve.engine.scheduler.scheduler import Scheduler, StepOutput

__all__ = ["KVManager", "Scheduler", "StepOutput", "check_lengths", "make_reqs"]
