"""Continuous batching scheduler (pure Python, no torch)."""

from engine.scheduler.kv_manager import KVManager
from engine.scheduler.requests import check_lengths, make_reqs
from engine.scheduler.scheduler import Scheduler, StepOutput

__all__ = ["KVManager", "Scheduler", "StepOutput", "check_lengths", "make_reqs"]
