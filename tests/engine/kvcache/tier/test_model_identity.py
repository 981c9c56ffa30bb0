"""The tier's model identity (engine/kvcache/tier/file.py file_identity) hashes the whole GGUF: two files
that differ only in a middle tensor get different fingerprints and one's records are refused by the other;
the hash is kept beside the tier and reused while the file's stat is unchanged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from swaserve.engine.core import SamplingParams
from swaserve.engine.kvcache.tier import file as tier_file
from swaserve.engine.kvcache.tier.file import IDENTITY_FILE, MmapTierIO, file_identity, fingerprint
from swaserve.engine.kvcache.tier.index import KVTier
from swaserve.llm import LLM
from swaserve.models.demo.tiny import demo_model_path
from tests.engine.kvcache.tier.test_file import fill


def _flip_middle_tensor(src: str, dst: Path) -> None:
    """dst: a copy of the GGUF `src` with one byte changed in the middle of its middle tensor's data."""
    shutil.copyfile(src, dst)
    tensors = sorted(GGUFReader(src).tensors, key=lambda t: t.data_offset)
    mid = tensors[len(tensors) // 2]
    off = mid.data_offset + mid.n_bytes // 2
    with open(dst, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture()
def big_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Two 6 MiB GGUFs (three 2 MiB tensors) equal but for one byte in the middle tensor."""
    a = tmp_path / "a.gguf"
    w = GGUFWriter(str(a), "test")
    for i in range(3):
        w.add_tensor(f"t{i}", np.full(1 << 19, float(i), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    b = tmp_path / "b.gguf"
    _flip_middle_tensor(str(a), b)
    assert os.path.getsize(a) == os.path.getsize(b) > 6 << 20
    return a, b


def test_a_middle_tensor_changes_the_identity(big_pair: tuple[Path, Path]) -> None:
    a, b = big_pair
    assert file_identity(str(a)) != file_identity(str(b))
    assert file_identity(str(a)) == file_identity(str(a))


def test_the_other_files_records_are_refused(tmp_path: Path, big_pair: tuple[Path, Path], pool) -> None:
    a, b = big_pair
    tier_dir = tmp_path / "tier"
    io = MmapTierIO(tier_dir, pool, 3, fingerprint([file_identity(str(a), tier_dir)]))
    tier = KVTier(io, 3, pool.full_per_block)
    fill(tier)
    io.close()
    io = MmapTierIO(tier_dir, pool, 3, fingerprint([file_identity(str(b), tier_dir)]))
    assert io.reinitialised and len(KVTier(io, 3, pool.full_per_block)) == 0
    io.close()


def test_the_hash_is_kept_while_the_file_is_unchanged(tmp_path: Path, big_pair: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = big_pair
    first = file_identity(str(a), tmp_path)
    assert (tmp_path / IDENTITY_FILE).exists()

    def no_hash(path: str, size: int) -> str:
        raise AssertionError("hashed again")

    with monkeypatch.context() as m:
        m.setattr(tier_file, "_hash_file", no_hash)
        assert file_identity(str(a), tmp_path) == first  # the kept hash: no second read of the file
    with open(a, "r+b") as f:  # a write in place (same size; its ctime moves): hashed again
        f.seek(os.path.getsize(a) // 2)
        f.write(b"\x7f")
    assert file_identity(str(a), tmp_path) != first
    (tmp_path / IDENTITY_FILE).write_text("not json")  # a damaged memo: hashed again, not an error
    assert file_identity(str(a), tmp_path) == file_identity(str(a))


def test_the_engine_refuses_a_tier_written_by_another_file(tmp_path: Path) -> None:
    b = tmp_path / "b.gguf"
    _flip_middle_tensor(demo_model_path(), b)
    kw = dict(cpu_matmul="exact", chunked_prefill_size=96, max_running_requests=2, max_total_tokens=512,
              swa_tokens=256, kv_offload_dir=str(tmp_path / "tier"), kv_offload_gb=0.05)
    prompt = [[2] + list(range(10, 200))]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with LLM(**kw) as llm:
        llm.generate(prompt, greedy)
        llm.engine.cache.evict_full(10**6)  # into the tier
        assert len(llm.engine.tier) > 0
    with LLM(**kw) as llm:  # the same file: its records are reused
        assert llm.engine.tier.reopened > 0
    with LLM(str(b), **kw) as llm:  # a middle tensor differs: none is
        assert llm.engine.tier.reopened == 0 and len(llm.engine.tier) == 0


def test_the_engine_refuses_a_tier_written_with_another_image_encoder(tmp_path: Path) -> None:
    """Image pages are keyed by the pixels' hash, so the encoder that made their KV is part of the tier's
    fingerprint: the demo model with its own mmproj reuses its records, with another mmproj (other
    weights) it reuses none."""
    from swaserve.models.demo.tiny import make_mmproj

    other = make_mmproj("tiny", str(tmp_path / "other.mmproj.gguf"), seed=7)
    kw = dict(cpu_matmul="exact", chunked_prefill_size=96, max_running_requests=2, max_total_tokens=512,
              swa_tokens=256, kv_offload_dir=str(tmp_path / "tier"), kv_offload_gb=0.05)
    prompt = [[2] + list(range(10, 200))]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with LLM(**kw) as llm:  # the demo model brings its own encoder
        assert llm.engine.vision_spec is not None
        llm.generate(prompt, greedy)
        llm.engine.cache.evict_full(10**6)
        assert len(llm.engine.tier) > 0
    with LLM(**kw) as llm:
        assert llm.engine.tier.reopened > 0
    with LLM(mmproj=other, **kw) as llm:
        assert llm.engine.tier.reopened == 0
    assert (tmp_path / "tier" / "swaserve-kv.mmproj-hash").exists()
