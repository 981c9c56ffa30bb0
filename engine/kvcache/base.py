"""The prefix-cache interface: token ids and page ids in, opaque handles out; knows nothing of requests."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Match:
    reused_len: int  # X: page-aligned number of prompt tokens whose KV can be reused
    handle: Any  # lock it before anything can evict (allocation, another insert's eviction)
    full_pages: list[int]  # X / P full-pool page ids for [0, X)
    swa_pages: list[int | None]  # X / P entries; live ids on the window [X - W, X), None before it


@dataclass(frozen=True)
class InsertResult:
    handle: Any  # the node ending at inserted_len; not locked
    full_pages: list[int]  # the caller's list with [0, inserted_len / P) replaced by the cache's ids
    swa_pages: list[int | None]  # same; None before the window [inserted_len - W, inserted_len)
    inserted_len: int  # floor(len(token_ids) / P) * P; pages before it now belong to the cache


class PrefixCache(ABC):
    """A paged prefix cache over two pools (full-attention and sliding-window KV)."""

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> Match: ...

    @abstractmethod
    def insert(self, token_ids: Sequence[int], full_pages: Sequence[int], swa_pages: Sequence[int | None],
               anchors: Sequence[int] = (), prompt_len: int | None = None,
               finished: bool = False) -> InsertResult: ...

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def evict_full(self, n: int) -> int: ...

    @abstractmethod
    def evict_swa(self, n: int) -> int: ...

    @abstractmethod
    def evictable_full(self) -> int: ...

    @abstractmethod
    def evictable_swa(self) -> int: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def check_integrity(self, used_full: int | None = None, used_swa: int | None = None) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...
