"""Building the second KV tier from the engine's configuration (`--kv-offload-dir`, `--kv-offload-gb`,
`--kv-offload-host-gb`): the memory-mapped file (engine/kvcache/tier/file.py), the host level or write-behind
staging in front of it (engine/kvcache/tier/host.py, copies through engine/kvcache/tier/copies.py) and the
index over both (engine/kvcache/tier/index.py). engine/builder.py attaches the result to the cache
(PrefixCache.set_tier). Uses torch (through the file and host levels).
"""

from __future__ import annotations

import logging

from swaserve.engine.attention.kv_pool import ArenaKVPool
from swaserve.engine.config import EngineConfig
from swaserve.engine.kvcache.tier.copies import HostCopies
from swaserve.engine.kvcache.tier.file import MmapTierIO, file_identity, fingerprint
from swaserve.engine.kvcache.tier.host import STAGING_BYTES, HostTierIO
from swaserve.engine.kvcache.tier.index import KVTier
from swaserve.engine.model_api import ModelBundle

log = logging.getLogger("swaserve.engine")

HOST_GB_CUDA = 4.0  # the default host level on CUDA (--kv-offload-host-gb)
MMPROJ_IDENTITY_FILE = "swaserve-kv.mmproj-hash"  # the image encoder file's hash, kept beside the model's


def build_tier(cfg: EngineConfig, bundle: ModelBundle, pool: ArenaKVPool) -> KVTier:
    """The second KV tier (`--kv-offload-dir`, `--kv-offload-gb`): a memory-mapped file of arena-shaped
    blocks whose records carry a fingerprint of the model file, its config, the KV layout and the numerics."""
    c = cfg.cache
    assert c.kv_offload_dir is not None
    block_bytes = pool.page_size * pool.swa_record * pool.buffer.element_size()
    blocks = int(c.kv_offload_gb * 2**30 // block_bytes)
    if blocks < 1:
        raise ValueError(f"--kv-offload-gb {c.kv_offload_gb} is less than one KV block "
                         f"({block_bytes / 2**20:.2f} MiB)")
    model = file_identity(bundle.path, c.kv_offload_dir)  # the whole file's hash (kept in the directory)
    parts = ["swaserve-kv-tier", 3, model, bundle.config, pool.kv_format.name, pool.page_size,
             pool.full_per_block, pool.full_record, pool.swa_record, cfg.cpu_matmul, bundle.device.type]
    if bundle.vision is not None and bundle.vision_path is not None:
        # image pages are keyed by the pixels' hash: the encoder that made their KV and its attention rule
        # are part of what the bytes mean (another mmproj, or causal vs bidirectional, never shares them)
        enc = model if bundle.vision_path == bundle.path else \
            file_identity(bundle.vision_path, c.kv_offload_dir, memo_name=MMPROJ_IDENTITY_FILE)
        parts += ["vision", enc, bundle.vision_spec]
    fp = fingerprint(parts)
    disk = MmapTierIO(c.kv_offload_dir, pool, blocks, fp)
    host_gb = c.kv_offload_host_gb
    if host_gb is None:
        host_gb = HOST_GB_CUDA if bundle.device.type == "cuda" else 0.0
    host_bytes = min(host_gb * 2**30, blocks * block_bytes) if host_gb > 0 else \
        min(STAGING_BYTES, blocks * block_bytes)
    host_blocks = max(1, int(host_bytes // block_bytes))
    io = HostTierIO(disk, host_blocks, retain=host_gb > 0, copies=HostCopies(bundle.device))
    tier = KVTier(io, blocks, pool.full_per_block, name="host+disk" if host_gb > 0 else "disk")
    log.info("KV offload tier: %s, %d blocks (%.2f GiB), %d records reused%s; %s %.2f GiB%s", disk.path,
             blocks, blocks * block_bytes / 2**30, tier.reopened,
             " (file reinitialised)" if disk.reinitialised else "",
             "host level" if host_gb > 0 else "write-behind staging", host_blocks * block_bytes / 2**30,
             " pinned" if bundle.device.type == "cuda" else "")
    return tier
