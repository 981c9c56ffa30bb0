"""Triton attention backend over the paged full and SWA pools.

Per layer: the new K/V are written to their slots, then sequences with one new token run the
split-K decode kernel (+ a reduce over splits) and the others the varlen prefill kernel, which
reads the cached prefix and the new tokens alike through the page table (on sliding layers with
per-token key ends under bidirectional image attention: AttentionMetadata.key_ends). q8_0 K/V (uint8
pool views of 34-byte blocks) are dequantized in the kernels; fp8_e4m3 K/V (scale 1.0) are converted
there (sm_89+).
"""

from __future__ import annotations

import torch
import triton

from swaserve.engine.attention import triton_kernels as kernels
from swaserve.engine.attention.base import AttentionBackend, AttentionMetadata, write_kv
from swaserve.engine.attention.kv_pool import KVPool
from swaserve.engine.quant.kv_quant import head_dim
from swaserve.engine.quant.triton_q4 import check_triton_device
from swaserve.engine.quant.triton_q4 import dot_f32 as use_dot_f32
from swaserve.engine.runner.staging import pack_to_device


def kv_type(cache: torch.Tensor) -> int:
    """The kernels' K_TYPE / V_TYPE of a pool view: 0 float, 1 q8_0 (uint8 blocks), 2 fp8_e4m3."""
    return {torch.uint8: 1, torch.float8_e4m3fn: 2}.get(cache.dtype, 0)


def _check_fp8(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer "
                         "(Ada, Hopper); use q8_0")


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output/partial buffers (tests replace this to poison them with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


class _BatchInfo:
    """Index tensors derived from (q_lens, prefix_lens), shared by all layers of one step.

    Taken from the metadata's staged device copies when present; otherwise staged here (pinned,
    non-blocking). Nothing here waits for the device."""

    def __init__(self, meta: AttentionMetadata, device: torch.device):
        self.key = (tuple(meta.q_lens), tuple(meta.prefix_lens), device)
        self.device = device
        decodes = [b for b, q in enumerate(meta.q_lens) if q == 1]
        staged = (meta.cu_q_lens_t, meta.prefix_lens_t, meta.decode_seqs_t)
        if any(t is None or t.device != device for t in staged):
            staged = tuple(pack_to_device([meta.cu_q_lens, meta.prefix_lens, decodes], torch.int32, device))
        self.cu_q_lens, self.prefix_lens, self.decode_seqs = staged  # [B + 1], [B], [BD] int32
        self.num_decodes = len(decodes)
        self.prefill_seqs = [(b, q) for b, q in enumerate(meta.q_lens) if q > 1]  # (batch index, q_len)
        self.max_decode_len = max((meta.prefix_lens[b] + 1 for b in decodes), default=0)
        # block_m -> (blk_seq, blk_start), built by prefill_blocks on first use per block size
        self._prefill_blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prefill_blocks(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(blk_seq, blk_start) [NB] int32: one program per `block_m` query tokens of a prefill sequence."""
        if block_m not in self._prefill_blocks:
            seq, start = [], []
            for b, q in self.prefill_seqs:
                for m0 in range(0, q, block_m):
                    seq.append(b)
                    start.append(m0)
            blk_seq, blk_start = pack_to_device([seq, start], torch.int32, self.device)
            self._prefill_blocks[block_m] = (blk_seq, blk_start)
        return self._prefill_blocks[block_m]


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, scale: float = 1.0, decode_splits: int | None = None,
                 block_m: int | None = None, block_n: int | None = None):
        if not torch.cuda.is_available():  # fail at startup, not at the first batch
            check_triton_device(torch.device("cpu"), "the triton attention backend")
        self.scale = scale
        self.decode_splits = decode_splits  # None = chosen from context length and SM count
        self.block_m = block_m  # None = per head_dim defaults (tests use small blocks)
        self.block_n = block_n
        self._batch: _BatchInfo | None = None  # the last step's index tensors (reused by its layers)
        self._num_sms: dict[torch.device, int] = {}
        self._smem: dict[torch.device, int | None] = {}
        # True while CUDA graphs are captured: the decode split count follows the GPU's occupancy only,
        # not the context length (a graph replays with whatever lengths the static buffers hold)
        self.length_free_splits = False

    def _batch_info(self, meta: AttentionMetadata, device: torch.device) -> _BatchInfo:
        key = (tuple(meta.q_lens), tuple(meta.prefix_lens), device)
        if self._batch is None or self._batch.key != key:
            self._batch = _BatchInfo(meta, device)
        return self._batch

    def _sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            n = 4
            if device.type == "cuda":
                n = torch.cuda.get_device_properties(device).multi_processor_count
            self._num_sms[device] = n
        return self._num_sms[device]

    def _shared(self, device: torch.device) -> int | None:
        """Shared memory per block of the device (opt-in maximum); None off CUDA."""
        if device.type != "cuda":
            return None
        if device not in self._smem:
            props = torch.cuda.get_device_properties(device)  # opt-in limit = per SM less 1 KB reserved
            self._smem[device] = props.shared_memory_per_multiprocessor - 1024
        return self._smem[device]

    def num_splits(self, eff_len: int, num_dec: int, kvh: int, device: torch.device) -> int:
        """Splits of the key range per decode sequence: enough programs to fill the GPU, >= 128 keys each."""
        if self.decode_splits is not None:
            return max(1, self.decode_splits)
        by_len = 64 if self.length_free_splits else triton.cdiv(max(eff_len, 1), 128)
        by_occupancy = triton.cdiv(2 * self._sms(device), max(num_dec * kvh, 1))
        return max(1, min(by_len, by_occupancy, 64))

    @staticmethod
    def _key_ends(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
        """meta.key_ends as an int32 [T] tensor on `device` (the staged copy, or staged here once)."""
        if meta.key_ends_t is not None and meta.key_ends_t.device == device:
            return meta.key_ends_t
        key = ("triton_key_ends", device)
        if key not in meta.backend_plans:
            meta.backend_plans[key] = pack_to_device([meta.key_ends], torch.int32, device)[0]
        return meta.backend_plans[key]

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        meta: AttentionMetadata,
        pool: KVPool,
    ) -> torch.Tensor:  # [T, H, D]
        check_triton_device(q.device, "the triton attention backend")
        sliding, k_cache, v_cache = write_kv(layer, k, v, meta, pool)  # [S, KVH, R]
        page_table = meta.swa_page_table if sliding else meta.full_page_table  # [B, MP]
        return self.attend(q, k_cache, v_cache, page_table, meta, sliding)

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [S, KVH, R] pool view (R = D, or D / 32 * 34 bytes of q8_0 blocks)
        v_cache: torch.Tensor,  # [S, KVH, R]
        page_table: torch.Tensor,  # [B, MP] int64
        meta: AttentionMetadata,
        sliding: bool,
        out: torch.Tensor | None = None,  # [T, H, D], written in place when given
    ) -> torch.Tensor:  # [T, H, D]
        """Attention of the new tokens over the paged K/V (already holding the new tokens' K/V)."""
        T, H, D = q.shape
        KVH = k_cache.shape[1]
        if H % KVH != 0 or D & (D - 1) != 0 or head_dim(k_cache) != D or head_dim(v_cache) != D:
            raise ValueError(f"unsupported attention shape: {H} heads, {KVH} kv heads, head_dim {D}")
        if q.stride(2) != 1:
            q = q.contiguous()
        assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
        page_table = page_table.to(device=q.device, dtype=torch.int64).contiguous()
        info = self._batch_info(meta, q.device)
        G = H // KVH
        window = meta.window if sliding else 0
        k_type, v_type = kv_type(k_cache), kv_type(v_cache)
        if 2 in (k_type, v_type):
            _check_fp8(q.device)
        # 8-bit K is converted to the query's dtype for the dot (fp32 queries: fp32 dots)
        dot_f32 = use_dot_f32(k_cache.dtype if k_type == 0 else q.dtype)
        # q8_0 blocks are read as 2-byte words: int16 views of the same bytes (unused for other types)
        k_words = k_cache.view(torch.int16) if k_type == 1 else k_cache
        v_words = v_cache.view(torch.int16) if v_type == 1 else v_cache
        if out is None:
            out = empty(T, H, D, dtype=q.dtype, device=q.device)
        assert out.shape == q.shape and out.stride(2) == 1
        if info.prefill_seqs:  # packed GQA: a tile = BLOCK_M // G tokens x the G heads of one KV head
            q8 = 1 in (k_type, v_type)
            bm, bn, warps, stages = kernels.prefill_block_sizes(D, G, self._shared(q.device), q8)
            bm = kernels.prefill_rows(G, self.block_m) if self.block_m else bm
            bn = self.block_n or bn
            blk_seq, blk_start = info.prefill_blocks(bm // G)
            bidir = sliding and meta.key_ends is not None
            kend = self._key_ends(meta, q.device) if bidir else info.cu_q_lens  # unread when not bidir
            kernels._prefill_kernel[(blk_seq.numel(), KVH)](
                q, k_cache, v_cache, k_words, v_words, out, blk_seq, blk_start, info.cu_q_lens,
                info.prefix_lens, page_table, kend,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                page_table.stride(0), self.scale, window,
                G=G, PAGE=meta.page_size, D=D, BLOCK_M=bm, BLOCK_N=bn,
                SLIDING=sliding, DOT_F32=dot_f32, K_TYPE=k_type, V_TYPE=v_type, BIDIR=bidir,
                num_warps=warps, num_stages=stages,
            )
        if info.num_decodes:
            eff = min(info.max_decode_len, meta.window) if sliding else info.max_decode_len
            splits = self.num_splits(eff, info.num_decodes, KVH, q.device)
            bn, warps, stages = kernels.decode_block_sizes(D)
            bn = self.block_n or bn
            part_o = empty(info.num_decodes, H, splits, D, dtype=torch.float32, device=q.device)
            part_lse = empty(info.num_decodes, H, splits, dtype=torch.float32, device=q.device)
            kernels._decode_kernel[(info.num_decodes, KVH, splits)](
                q, k_cache, v_cache, k_words, v_words, part_o, part_lse, info.decode_seqs, info.cu_q_lens,
                info.prefix_lens, page_table,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
                self.scale, window, splits,
                G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), PAGE=meta.page_size, D=D,
                BLOCK_N=bn, SLIDING=sliding, DOT_F32=dot_f32, K_TYPE=k_type, V_TYPE=v_type,
                num_warps=warps, num_stages=stages,
            )
            kernels._decode_reduce_kernel[(info.num_decodes, H)](
                part_o, part_lse, out, info.decode_seqs, info.cu_q_lens, out.stride(0), out.stride(1), splits,
                D=D, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
            )
        return out
