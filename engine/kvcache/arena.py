"""One memory budget for both KV page kinds: a two-level allocator over blocks (pure Python).

The arena has num_blocks blocks of equal bytes. A block holds either one SWA page (its id is the
block id) or `full_per_block` full-attention pages (ids block * full_per_block + j): on Gemma 4 a
token of SWA KV costs 10x a token of full KV, so a block of one SWA page's bytes holds 10 full pages of
the same page_size tokens, and the radix tree keeps one page granularity for both kinds. A block
changes kind only while free, so the split between the kinds follows the workload; `swa_cap`
optionally bounds the SWA blocks (--swa-full-tokens-ratio).

`arena.full` and `arena.swa` are the two kinds' allocators, with PageAllocator's interface: the cache
and the scheduler use them unchanged. num_free is what alloc() can hand out now (free slots of
partly used full blocks plus whole free blocks); accounting per kind is num_used (pages handed out)
== pages held by requests + pages cached, and for the arena free + full + SWA blocks == total.
Full pages fill the most-used partial blocks first, so that freed pages tend to free whole blocks.
"""

from __future__ import annotations

FREE, SWA, FULL = 0, 1, 2


class Arena:
    def __init__(self, num_blocks: int, full_per_block: int, swa_cap: int | None = None,
                 block_bytes: int = 0):
        if num_blocks < 0 or full_per_block < 1:
            raise ValueError(f"bad arena: {num_blocks} blocks, {full_per_block} full pages per block")
        k = full_per_block
        self.num_blocks = num_blocks
        self.full_per_block = k
        self.block_bytes = block_bytes  # for stats only
        self.swa_cap = num_blocks if swa_cap is None else max(0, min(swa_cap, num_blocks))
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # stack: lowest id first
        self._kind = bytearray(num_blocks)
        self._slot_used = bytearray(num_blocks * k)  # per full page id: 1 = handed out
        self._used_in = [0] * num_blocks  # full pages handed out, per FULL block
        # FULL blocks with free slots, by the number of pages handed out (1 .. k - 1)
        self._partial: list[dict[int, None]] = [{} for _ in range(k)]
        self.full_blocks = 0
        self.swa_blocks = 0
        self.full_used = 0
        self.full = ArenaPages(self, FULL)
        self.swa = ArenaPages(self, SWA)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    # ---- full pages -----------------------------------------------------------------------------
    def full_allocatable(self) -> int:
        k = self.full_per_block
        return self.full_blocks * k - self.full_used + len(self._free_blocks) * k

    def alloc_full(self, n: int) -> list[int] | None:
        k = self.full_per_block
        if n > self.full_allocatable():
            return None
        out: list[int] = []
        for used in range(k - 1, 0, -1):  # the most-used partial blocks first
            bucket = self._partial[used]
            while bucket and len(out) < n:
                b = next(iter(bucket))
                self._take_slots(b, n - len(out), out)
        while len(out) < n:
            b = self._free_blocks.pop()
            self._kind[b] = FULL
            self.full_blocks += 1
            self._take_slots(b, n - len(out), out)
        return out

    def _take_slots(self, b: int, want: int, out: list[int]) -> None:
        k = self.full_per_block
        used = self._used_in[b]
        if used:
            del self._partial[used][b]
        flags = self._slot_used
        for f in range(b * k, (b + 1) * k):
            if want == 0:
                break
            if not flags[f]:
                flags[f] = 1
                out.append(f)
                want -= 1
                used += 1
        self.full_used += used - self._used_in[b]
        self._used_in[b] = used
        if used < k:
            self._partial[used][b] = None

    def free_full(self, pages: list[int]) -> None:
        k = self.full_per_block
        flags = self._slot_used
        for f in pages:
            assert 0 <= f < self.num_blocks * k, f"full page {f} outside the arena"
            assert flags[f], f"full page {f} freed twice"
            b = f // k
            flags[f] = 0
            used = self._used_in[b]
            if used < k:
                del self._partial[used][b]
            used -= 1
            self._used_in[b] = used
            self.full_used -= 1
            if used:
                self._partial[used][b] = None
            else:
                self._kind[b] = FREE
                self.full_blocks -= 1
                self._free_blocks.append(b)

    # ---- SWA pages ------------------------------------------------------------------------------
    def swa_allocatable(self) -> int:
        return min(len(self._free_blocks), self.swa_cap - self.swa_blocks)

    def alloc_swa(self, n: int) -> list[int] | None:
        if n > self.swa_allocatable():
            return None
        if n == 0:
            return []
        out = self._free_blocks[-n:]
        del self._free_blocks[-n:]
        out.reverse()
        for b in out:
            self._kind[b] = SWA
        self.swa_blocks += n
        return out

    def free_swa(self, pages: list[int]) -> None:
        for b in pages:
            assert 0 <= b < self.num_blocks, f"SWA page {b} outside the arena"
            assert self._kind[b] == SWA, f"SWA page {b} freed twice"
            self._kind[b] = FREE
            self._free_blocks.append(b)
        self.swa_blocks -= len(pages)

    # ---- checks and stats -------------------------------------------------------------------------
    def check(self) -> None:
        """AssertionError unless every counter agrees with a from-scratch recount."""
        k = self.full_per_block
        assert len(set(self._free_blocks)) == len(self._free_blocks), "duplicate free block"
        assert all(self._kind[b] == FREE for b in self._free_blocks), "a listed free block is in use"
        kinds = [0, 0, 0]
        for kind in self._kind:
            kinds[kind] += 1
        assert kinds[FREE] == len(self._free_blocks), "free blocks disagree with the free list"
        assert kinds[SWA] == self.swa_blocks <= self.swa_cap and kinds[FULL] == self.full_blocks
        assert kinds[FREE] + kinds[SWA] + kinds[FULL] == self.num_blocks
        used_total = 0
        for b in range(self.num_blocks):
            used = sum(self._slot_used[b * k:(b + 1) * k])
            used_total += used
            assert used == self._used_in[b] or self._kind[b] != FULL, f"block {b}: used count"
            if self._kind[b] != FULL:
                assert used == 0, f"block {b} is not a full block but holds full pages"
            else:
                assert used > 0, f"full block {b} holds no page"
                assert used == k or b in self._partial[used], f"block {b}: partial index"
        assert used_total == self.full_used
        assert sum(len(d) for d in self._partial) == sum(
            1 for b in range(self.num_blocks) if self._kind[b] == FULL and self._used_in[b] < k)

    def stats(self) -> dict[str, int]:
        k = self.full_per_block
        return {"blocks_total": self.num_blocks, "blocks_free": len(self._free_blocks),
                "blocks_full": self.full_blocks, "blocks_swa": self.swa_blocks,
                "swa_cap_blocks": self.swa_cap, "full_per_block": k,
                "full_pages_free_in_blocks": self.full_blocks * k - self.full_used,
                "block_bytes": self.block_bytes}


class ArenaPages:
    """One kind's allocator over the arena (PageAllocator's interface)."""

    def __init__(self, arena: Arena, kind: int):
        self.arena = arena
        self.kind = kind

    @property
    def num_free(self) -> int:
        """Pages of this kind alloc() can hand out now."""
        a = self.arena
        return a.full_allocatable() if self.kind == FULL else a.swa_allocatable()

    @property
    def num_total(self) -> int:
        """The most pages of this kind the arena can hold (all blocks, or the SWA cap)."""
        a = self.arena
        return a.num_blocks * a.full_per_block if self.kind == FULL else a.swa_cap

    @property
    def num_ids(self) -> int:
        """Page ids are 0 .. num_ids - 1 (every block, whatever the SWA cap)."""
        a = self.arena
        return a.num_blocks * a.full_per_block if self.kind == FULL else a.num_blocks

    @property
    def num_used(self) -> int:
        """Pages handed out (held by requests or by the prefix cache)."""
        a = self.arena
        return a.full_used if self.kind == FULL else a.swa_blocks

    @property
    def num_carved(self) -> int:
        """Pages the blocks of this kind hold now (free or handed out)."""
        a = self.arena
        return a.full_blocks * a.full_per_block if self.kind == FULL else a.swa_blocks

    @property
    def num_carved_free(self) -> int:
        """Free pages inside the blocks of this kind (num_carved - num_used)."""
        return self.num_carved - self.num_used

    def alloc(self, n: int) -> list[int] | None:
        """n page ids, or None (allocating nothing) when fewer than n can be handed out."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        return self.arena.alloc_full(n) if self.kind == FULL else self.arena.alloc_swa(n)

    def free(self, pages: list[int]) -> None:
        if self.kind == FULL:
            self.arena.free_full(pages)
        else:
            self.arena.free_swa(pages)

    def is_free(self, page: int) -> bool:
        a = self.arena
        if self.kind == FULL:
            return not a._slot_used[page]
        return a._kind[page] != SWA

    def check(self) -> None:
        self.arena.check()
