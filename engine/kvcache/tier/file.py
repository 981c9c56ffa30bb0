"""The second KV tier's bytes: a memory-mapped file on local disk (`--kv-offload-dir`, `--kv-offload-gb`).

engine/kvcache/tier/index.py keeps the index (pure Python); this module implements its TierIO over the
KV arena (engine/attention/kv_pool.py's ArenaKVPool): a slot holds one page record of a kind, laid out as
the arena lays out pages (a block: one SWA page or full_per_block full pages), so a page moves with one
copy.

File layout: a 4 KiB file header (magic, format version, KV types, fingerprint, geometry), then one 64-byte
record header per slot (full slots, then SWA slots), then the payload blocks (4 KiB aligned). A record header
holds a magic, the kind, the page's radix-path key, the fingerprint of the model (a hash of the whole GGUF:
file_identity) and KV layout and the CRC-32 of the payload. A write clears the header, copies the payload,
then seals the header; a read checks header, fingerprint, key and CRC before it copies anything. So a torn
write, a corrupted or truncated file, a file of another model or layout, is detected and the record is not
served (the page is recomputed). A file whose header or size does not match is reinitialised on open; a
file shrunk while open is noticed before each read (no access beyond its end). On a GPU the copies go
through this file's host mapping too (a pinned host-memory tier in front of it is not built).
Records are the arena's bytes as they are (8-bit for q8_0 / fp8 KV); a file of another format version or
KV types is refused with a warning naming both (and reinitialised), never read as this one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from swaserve.engine.attention.kv_pool import ArenaKVPool

log = logging.getLogger("swaserve.engine")

MAGIC = b"SWAKVT"
# 1: up to fp32 / fp16 / bf16 KV, no version field (magic b"SWAKVT01"); 2: the KV types in the header
FORMAT_VERSION = 2
FILE_NAME = "swaserve-kv.tier"
FILE_HEADER = 4096
# magic, format version, KV types ("k,v"), fingerprint, blocks, full pages per block, page bytes (full,
# swa), payload offset
FILE_HEAD = struct.Struct("<6sH32s16sQQQQQ")
REC = struct.Struct("<4sB3x16s16sIQ")  # magic, kind, key, fingerprint, crc32, payload bytes
REC_BYTES = 64
REC_MAGIC = b"KVR2"  # format 1's records: b"KVR1"
KIND_CODE = {"full": 1, "swa": 2}


def _align(x: int, a: int = 4096) -> int:
    return -(-x // a) * a


def fingerprint(parts: Iterable[object]) -> bytes:
    """16-byte fingerprint of whatever determines the KV bytes (model identity, config, layout, numerics)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.digest()


HASH_CHUNK = 16 << 20  # bytes per hashlib update (it releases the GIL over each)
SEGMENT = 1 << 30  # bytes per thread: segments are hashed in parallel (hashlib releases the GIL)
PROGRESS_S = 1.0  # a hash taking longer shows a progress bar
IDENTITY_FILE = "swaserve-kv.model-hash"  # beside the tier file: the last whole-file hash and the stat it had


def _stat_key(st: os.stat_result) -> list[int]:
    # any write to the file changes its ctime (which no user can set): a match means the same bytes
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_identity(path: str, cache_dir: str | os.PathLike | None = None,
                  memo_name: str = IDENTITY_FILE) -> tuple[int, str]:
    """(size, SHA-256 of the whole file) of a model file: its identity in a fingerprint, so two GGUFs that
    differ anywhere (a middle tensor included) never share a tier. The file is read once, SEGMENTs in
    parallel threads (a progress bar past PROGRESS_S); with `cache_dir` the hash is kept there and reused
    while the file's stat (device, inode, size, mtime, ctime) is unchanged (`memo_name`: one memo a file)."""
    st = os.stat(path)
    memo = Path(cache_dir) / memo_name if cache_dir is not None else None
    if memo is not None:
        try:
            kept = json.loads(memo.read_text())
            if kept["path"] == os.path.realpath(path) and kept["stat"] == _stat_key(st):
                return st.st_size, kept["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    digest = _hash_file(path, st.st_size)
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(".tmp")
            kept = {"path": os.path.realpath(path), "stat": _stat_key(st), "sha256": digest}
            tmp.write_text(json.dumps(kept))
            os.replace(tmp, memo)
        except OSError as e:
            log.warning("KV offload tier: cannot keep the model hash in %s: %s", memo, e)
    return st.st_size, digest


def _hash_range(path: str, start: int, end: int, done: list[int], slot: int) -> bytes:
    h = hashlib.sha256()  # SHA-NI where the CPU has it: about 3x blake2b's speed
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while start < end and (n := f.readinto(view[:min(HASH_CHUNK, end - start)])):
            h.update(view[:n])
            start += n
            done[slot] += n  # this thread's slot only
    return h.digest()


def _hash_file(path: str, size: int) -> str:
    t0 = time.monotonic()
    starts = list(range(0, size, SEGMENT)) or [0]
    done = [0] * len(starts)  # bytes hashed, per segment
    workers = max(1, min(len(starts), os.cpu_count() or 1, 8))
    bar = None
    with ThreadPoolExecutor(workers, thread_name_prefix="model-hash") as pool:
        jobs = [pool.submit(_hash_range, path, a, min(a + SEGMENT, size), done, i)
                for i, a in enumerate(starts)]
        while wait(jobs, timeout=0.25).not_done:
            if bar is None and time.monotonic() - t0 > PROGRESS_S:
                from tqdm import tqdm

                bar = tqdm(total=size, unit="B", unit_scale=True, desc="KV tier: hashing the model file",
                           leave=False)
            if bar is not None:
                bar.update(sum(done) - bar.n)
        h = hashlib.sha256(size.to_bytes(8, "little"))
        for job in jobs:
            h.update(job.result())
    if bar is not None:
        bar.close()
    log.info("KV offload tier: hashed the model file (%.2f GiB) in %.1f s", size / 2**30,
             time.monotonic() - t0)
    return h.hexdigest()[:32]


def kv_types(pool: ArenaKVPool) -> str:
    """The pool's KV storage types as the file header records them: "k,v" (e.g. "q8_0,q8_0")."""
    return f"{pool.kv_format.k.name},{pool.kv_format.v.name}"


def written_with(head: bytes) -> tuple[int, str] | None:
    """(format version, KV types) of a file header's first bytes; None when it is no tier file."""
    if head.startswith(b"SWAKVT01"):
        return 1, "fp32, fp16 or bf16"
    if len(head) < FILE_HEAD.size or not head.startswith(MAGIC):
        return None
    _, version, kv, *_ = FILE_HEAD.unpack_from(head)
    return version, kv.rstrip(b"\0").decode(errors="replace")


def copy_record(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one page record: a plain memcpy between host tensors (torch's parallel copy is many times slower
    on a busy machine), torch's copy to or from a device."""
    if dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        assert dst.nbytes == src.nbytes
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
    else:
        dst.copy_(src)


def host_crc(t: torch.Tensor) -> int:
    """CRC-32 of a contiguous host tensor's bytes (zlib releases the GIL while it runs)."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return zlib.crc32((ctypes.c_char * t.nbytes).from_address(t.data_ptr()))


class MmapTierIO:
    """TierIO over a memory-mapped file (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, pool: ArenaKVPool, num_blocks: int, fp: bytes):
        if num_blocks < 1:
            raise ValueError("the second KV tier must hold at least one block")
        assert len(fp) == 16
        self.pool, self.fp, self.num_blocks = pool, fp, num_blocks
        k = pool.full_per_block
        el = pool.buffer.element_size()
        self.page_bytes = {"full": pool.page_size * pool.full_record * el,
                           "swa": pool.page_size * pool.swa_record * el}
        self.k = k
        self.n_slots = {"full": num_blocks * k, "swa": num_blocks}
        self.head_off = {"full": FILE_HEADER, "swa": FILE_HEADER + num_blocks * k * REC_BYTES}
        self.payload_off = _align(FILE_HEADER + num_blocks * (k + 1) * REC_BYTES)
        self.size = self.payload_off + num_blocks * self.page_bytes["swa"]
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / FILE_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            raise RuntimeError(
                f"{self.path} is in use by another process (one --kv-offload-dir per server)") from e
        kv = kv_types(pool)
        head = FILE_HEAD.pack(MAGIC, FORMAT_VERSION, kv.encode(), fp, num_blocks, k, self.page_bytes["full"],
                              self.page_bytes["swa"], self.payload_off)
        self.reinitialised = False
        old = os.pread(self.fd, FILE_HEAD.size, 0)
        if os.fstat(self.fd).st_size != self.size or old != head:
            was = written_with(old)
            if was is not None and was != (FORMAT_VERSION, kv):  # refused: never read as this format
                log.warning("KV tier file %s was written by record format %d with KV %s; this server writes "
                            "format %d with KV %s: its records are not used, the file is reinitialised",
                            self.path, was[0], was[1], FORMAT_VERSION, kv)
            os.ftruncate(self.fd, 0)  # stale, torn or another layout: start empty (sparse)
            os.ftruncate(self.fd, self.size)
            os.pwrite(self.fd, head, 0)
            self.reinitialised = True
        self.mm = mmap.mmap(self.fd, self.size)
        self.payload = torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.payload_off,
                                        count=num_blocks * self.page_bytes["swa"])
        self.broken = False

    # ---- helpers ----------------------------------------------------------------------------------
    def _rec_off(self, kind: str, slot: int) -> int:
        return self.head_off[kind] + slot * REC_BYTES

    def _payload(self, kind: str, slot: int) -> tuple[int, torch.Tensor]:
        n = self.page_bytes[kind]
        return self.payload_off + slot * n, self.payload[slot * n:(slot + 1) * n]

    def pool_page(self, kind: str, page: int) -> torch.Tensor:
        """Page `page` of `kind` in the KV pool (on the pool's device), viewed as bytes."""
        return self.pool.page_tensor(kind)[page].view(torch.uint8)

    def _intact(self) -> bool:
        if not self.broken and os.fstat(self.fd).st_size < self.size:
            self.broken = True  # shrunk under us: reading the mapping would fault
        return not self.broken

    def _crc(self, off: int, n: int) -> int:
        with memoryview(self.mm) as mv:
            return zlib.crc32(mv[off:off + n])

    # ---- the halves of a write (engine/kvcache/tier/host.py's writer calls them from its thread) ----------
    def unseal(self, kind: str, slot: int) -> None:
        """Clear the record header of `slot`: from now until seal() the record is not valid."""
        if self._intact():
            ro = self._rec_off(kind, slot)
            self.mm[ro:ro + REC_BYTES] = bytes(REC_BYTES)

    def fill(self, kind: str, slot: int, src: torch.Tensor) -> int | None:
        """Copy one record's bytes (host or device tensor) into `slot`'s payload; its CRC-32 (None: the
        file is broken). The slot must be unsealed."""
        if not self._intact():
            return None
        off, dst = self._payload(kind, slot)
        copy_record(dst, src)
        return self._crc(off, self.page_bytes[kind])

    def seal(self, kind: str, slot: int, key: bytes, crc: int) -> None:
        """Write the header that makes the record valid (after its payload is in place)."""
        if self._intact():
            n = self.page_bytes[kind]
            REC.pack_into(self.mm, self._rec_off(kind, slot), REC_MAGIC, KIND_CODE[kind], key, self.fp, crc,
                          n)

    def read_into(self, kind: str, slot: int, dst: torch.Tensor) -> bytes | None:
        """Copy a sealed record of this fingerprint into the host tensor `dst` and verify the copy (CRC-32
        of the bytes copied, so a record rewritten meanwhile fails); the record's key, or None."""
        if not self._intact():
            return None
        magic, code, rkey, rfp, crc, n = REC.unpack_from(self.mm, self._rec_off(kind, slot))
        if magic != REC_MAGIC or code != KIND_CODE[kind] or rfp != self.fp or n != self.page_bytes[kind]:
            return None
        _, src = self._payload(kind, slot)
        copy_record(dst, src)
        return rkey if host_crc(dst) == crc else None

    # ---- TierIO -----------------------------------------------------------------------------------
    def write(self, kind: str, page: int, slot: int, key: bytes) -> None:
        self.unseal(kind, slot)  # unsealed while the payload changes
        crc = self.fill(kind, slot, self.pool_page(kind, page))
        if crc is not None:
            self.seal(kind, slot, key, crc)

    def read(self, kind: str, slot: int, page: int, key: bytes) -> bool:
        if not self._intact():
            return False
        magic, code, rkey, rfp, crc, n = REC.unpack_from(self.mm, self._rec_off(kind, slot))
        if (magic != REC_MAGIC or code != KIND_CODE[kind] or rkey != key or rfp != self.fp
                or n != self.page_bytes[kind]):
            return False
        off, src = self._payload(kind, slot)
        if self._crc(off, n) != crc:
            return False
        copy_record(self.pool_page(kind, page), src)
        return True

    def prefetch(self, kind: str, slot: int) -> None:
        """Ask the kernel to start reading a record (MADV_WILLNEED): the reads of a promotion overlap."""
        if self._intact() and hasattr(mmap, "MADV_WILLNEED"):
            off = self.payload_off + slot * self.page_bytes[kind]
            start = off - off % mmap.PAGESIZE
            self.mm.madvise(mmap.MADV_WILLNEED, start, off + self.page_bytes[kind] - start)

    def invalidate(self, kind: str, slot: int) -> None:
        if self._intact():
            ro = self._rec_off(kind, slot)
            self.mm[ro:ro + 4] = bytes(4)

    def records(self) -> Iterable[tuple[str, int, bytes]]:
        """Sealed records of this fingerprint (payload checksums are verified on every read)."""
        out = []
        for kind, code in KIND_CODE.items():
            for slot in range(self.n_slots[kind]):
                magic, c, key, rfp, _, n = REC.unpack_from(self.mm, self._rec_off(kind, slot))
                if magic == REC_MAGIC and c == code and rfp == self.fp and n == self.page_bytes[kind]:
                    out.append((kind, slot, key))
        return out

    def close(self) -> None:
        del self.payload
        self.mm.close()
        os.close(self.fd)
