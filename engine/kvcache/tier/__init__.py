"""The second KV tier (`--kv-offload-dir`): pages evicted from the pools that a later request can use are
kept in a local file (with a host-memory level in front), and that request's admission promotes them back
into the pools instead of recomputing them. The cache holds it as PrefixCache.tier (engine/kvcache/base.py).

Pure Python (no torch; engine/kvcache's rule, tests/test_layout.py):
  * index.py: the tier's index (KVTier): records keyed by a page's radix-path hash chain, slots shaped like
    the arena's blocks, least recently used dropped first; TierIO is the interface to the bytes.
  * demotion.py: which evicted pages are written (mixed into SWARadixCache's eviction).
  * promotion.py: what an admission promotes back and how (KVManager.admit / prefetch), through the
    PrefixCache contract's tier walk (engine/kvcache/base.py).
  * pins.py: the host level's pins of records a queued request will promote.
The byte movers (torch; the only modules of engine/kvcache that may import it):
  * host.py: the host-memory level (or write-behind staging) in front of the file, with its background
    thread (HostTierIO, with pins.py).
  * file.py: the memory-mapped file of checksummed, fingerprinted records (MmapTierIO).
  * copies.py: the copies between the KV pool and host frames, per device (CPU memcpy, CUDA streams).
  * build.py: the tier the engine's configuration asks for (build_tier; engine/builder.py attaches it).
Importing this package imports none of them.
"""
