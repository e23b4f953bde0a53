"""PrefixDiskTier over a hand-made pool: exact round trips, refused files, the byte bound, a
writer that never blocks the loop, and the KV manager restoring a prefix through it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from fakes import make_request

from ifb.runtime.errors import LimitExceededError
from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.prefix_disk_tier import PrefixDiskTier, PrefixDiskTierConfig, _Spill, make_block_tier
from ifb.runtime.prefix_hash import prefix_block_keys
from ifb.runtime.runtime_config import RuntimeSettings, prefix_disk_tier_config
from ifb.runtime.windowed_kv_cache_manager import SlidingWindowBlocks, WindowedKVCacheManager

BLOCK = 4
NUM_BLOCKS = 8
GB = 10**9


def make_pool(seed: int = 0) -> torch.Tensor:
    """[layers, K/V, slots, kv_heads, head_dim], every value distinct per seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, NUM_BLOCKS * BLOCK, 3, 5), generator=generator)


def block_rows(pool: torch.Tensor, block_id: int) -> torch.Tensor:
    return pool[:, :, block_id * BLOCK : (block_id + 1) * BLOCK]


def make_tier(directory: Path, pool: torch.Tensor, build_id: str = "build-a", **kw: int) -> PrefixDiskTier:
    config = PrefixDiskTierConfig(directory, kw.pop("max_bytes", GB), **kw)
    return PrefixDiskTier(config, build_id, pool, BLOCK)


def key(i: int) -> bytes:
    return prefix_block_keys(list(range(100 + i, 100 + i + BLOCK)), BLOCK, None)[0]


def test_a_restarted_tier_restores_the_exact_rows(tmp_path: Path) -> None:
    """Spilled by one tier, closed; a new tier on the directory fills another block with the same bytes."""
    pool = make_pool()
    tier = make_tier(tmp_path, pool)
    tier.spill(key(0), 3)
    tier.close()
    assert tier.usage().bytes_written > 0
    fresh = make_pool(seed=1)
    again = make_tier(tmp_path, fresh)
    assert again.contains(key(0)) and not again.contains(key(1))
    assert again.restore(key(0), 5)
    assert torch.equal(block_rows(fresh, 5), block_rows(pool, 3))
    usage = again.usage()
    assert (usage.hit_tokens, usage.bytes_read, usage.rejected_files) == (BLOCK, tier.usage().bytes_written, 0)
    assert not again.restore(key(1), 6)
    again.close()


def test_a_spill_not_yet_written_is_restorable(tmp_path: Path) -> None:
    """Rows handed to a held writer come back from memory, copied when spilled (not read later)."""
    writing, release = threading.Event(), threading.Event()
    pool = make_pool()
    tier = held_tier(tmp_path, pool, writing, release)
    expected = block_rows(pool, 2).clone()
    tier.spill(key(0), 2)
    block_rows(pool, 2).zero_()  # the block is reused after the spill
    assert tier.restore(key(0), 6) and torch.equal(block_rows(pool, 6), expected)
    release.set()
    tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_bad_file_is_refused_counted_and_removed(tmp_path: Path, damage: str) -> None:
    """A flipped byte, a cut file, or another engine's block under this engine's name: a miss."""
    pool = make_pool()
    tier = make_tier(tmp_path, pool)
    tier.spill(key(0), 1)
    tier.close()
    path = tmp_path / tier.file_name(key(0))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[:-10])
    theirs = make_pool(seed=2)
    other = make_tier(tmp_path, theirs, build_id="build-b" if damage == "foreign" else "build-a")
    if damage == "foreign":  # build-a's block put where build-b would look for the same key
        assert not other.contains(key(0))
        path.rename(tmp_path / other.file_name(key(0)))
        other.close()
        other = make_tier(tmp_path, theirs, build_id="build-b")
        path = tmp_path / other.file_name(key(0))
    before = block_rows(theirs, 4).clone()
    assert other.contains(key(0))
    assert not other.restore(key(0), 4)
    assert torch.equal(block_rows(theirs, 4), before)
    assert other.usage().rejected_files == 1 and other.usage().hit_tokens == 0
    assert not path.exists() and not other.contains(key(0))
    other.close()


def test_files_stay_within_the_byte_bound_least_recently_used_first(tmp_path: Path) -> None:
    """Five blocks into room for two and a half: the two newest stay, and a restart with less room prunes."""
    pool = make_pool()
    probe = make_tier(tmp_path / "probe", pool)
    probe.spill(key(9), 0)
    probe.close()
    size = probe.usage().bytes_written
    tier = make_tier(tmp_path / "tier", pool, max_bytes=size * 5 // 2)
    for i in range(5):
        tier.spill(key(i), i)
    tier.close()
    files = list((tmp_path / "tier").iterdir())
    assert sum(f.stat().st_size for f in files) <= size * 5 // 2 and len(files) == 2
    assert [tier.contains(key(i)) for i in range(5)] == [False, False, False, True, True]
    for age, i in enumerate((3, 4)):  # file times may tie within a clock tick: make the order plain
        os.utime(tmp_path / "tier" / tier.file_name(key(i)), (1000 + age, 1000 + age))
    smaller = make_tier(tmp_path / "tier", pool, max_bytes=size)
    assert [smaller.contains(key(i)) for i in range(5)] == [False, False, False, False, True]
    assert len(list((tmp_path / "tier").iterdir())) == 1
    smaller.close()


class _HeldTier(PrefixDiskTier):
    """Its writer announces each write, then waits for `release`."""

    writing: threading.Event
    release: threading.Event

    def _write_file(self, spill: _Spill) -> int:
        self.writing.set()
        assert self.release.wait(60), "the test never released the writer"
        return PrefixDiskTier._write_file(self, spill)


def held_tier(
    directory: Path, pool: torch.Tensor, writing: threading.Event, release: threading.Event
) -> PrefixDiskTier:
    _HeldTier.writing, _HeldTier.release = writing, release
    return _HeldTier(PrefixDiskTierConfig(directory, GB, max_queued_blocks=2), "build-a", pool, BLOCK)


def test_a_full_queue_drops_the_spill_and_never_blocks(tmp_path: Path) -> None:
    """Writer busy, queue of 2 full: the 4th spill returns at once, dropped and counted."""
    writing, release = threading.Event(), threading.Event()
    tier = held_tier(tmp_path, make_pool(), writing, release)
    tier.spill(key(0), 0)
    assert writing.wait(60)  # the writer holds block 0; the queue is empty again
    tier.spill(key(1), 1)
    tier.spill(key(2), 2)
    tier.spill(key(3), 3)  # the queue holds 1 and 2: this one cannot wait (it would hang the test)
    assert tier.usage().dropped_spills == 1 and not tier.contains(key(3))
    release.set()
    tier.close()
    assert [tier.contains(key(i)) for i in range(4)] == [True, True, True, False]
    assert len(list(tmp_path.glob("*.kv"))) == 3


def test_the_kv_manager_restores_an_evicted_prefix_through_the_tier(tmp_path: Path) -> None:
    """A prompt's blocks evicted by other work come back from disk as cached blocks, content and all."""
    pool = make_pool()
    kv = KVCacheManager(NUM_BLOCKS, BLOCK)
    kv.attach_tier(make_tier(tmp_path, pool))
    prompt = list(range(10, 10 + 3 * BLOCK + 1))
    first = make_request(0, 1, prompt=prompt)
    kv.admit(first, kv.match_prefix(first))
    assert kv.allocate(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.publish(first)
    written = [block_rows(pool, b).clone() for b in first.block_ids[:3]]
    kv.free(first)
    filler = make_request(NUM_BLOCKS * BLOCK, 1)  # takes the whole pool: every cached block is evicted
    kv.admit(filler, [])
    assert kv.allocate(filler, NUM_BLOCKS * BLOCK) and kv.num_cached_blocks == 0
    pool[:, :, : NUM_BLOCKS * BLOCK] = 0.0  # the filler's own K/V
    kv.free(filler)
    kv.tier.close()  # the spills are written (restore would also serve them from memory)
    kv.attach_tier(make_tier(tmp_path, pool))
    second = make_request(0, 1, prompt=prompt)
    hits = kv.match_prefix(second)
    assert len(hits) == 3 and kv.tier.usage().hit_tokens == 3 * BLOCK
    for block_id, rows in zip(hits, written, strict=True):
        assert torch.equal(block_rows(pool, block_id), rows)
    kv.admit(second, hits)
    kv.check_integrity([second])
    assert kv.tier.usage().miss_tokens == 0
    kv.close()


def test_a_restore_never_evicts_the_chain_it_extends(tmp_path: Path) -> None:
    """Blocks 0-1 still cached, 2-4 on disk, 2 blocks free besides: only 2 come back and 0-1 stay."""
    pool = make_pool()
    kv = KVCacheManager(5, BLOCK)
    kv.attach_tier(make_tier(tmp_path, pool))
    prompt = list(range(40, 40 + 5 * BLOCK + 1))
    keys = prefix_block_keys(prompt, BLOCK, None)
    first = make_request(0, 1, prompt=prompt[: 2 * BLOCK])
    kv.admit(first, [])
    assert kv.allocate(first, 2 * BLOCK)
    first.num_computed_tokens = 2 * BLOCK
    kv.publish(first)
    for i in (2, 3, 4):
        kv.tier.spill(keys[i], i)
    held = list(first.block_ids)
    kv.free(first)
    later = make_request(0, 1, prompt=prompt)
    hits = kv.match_prefix(later)
    assert hits[:2] == held and len(hits) == 5  # 3 free blocks: all three restored
    kv.admit(later, hits)
    kv.check_integrity([later])
    kv.free(later)
    squeezed = KVCacheManager(4, BLOCK)  # the chain's RAM blocks at the free list's head: restores take the head
    squeezed.attach_tier(kv.tier)
    first, other = make_request(0, 1, prompt=prompt[: 2 * BLOCK]), make_request(2 * BLOCK, 1)
    for request in (first, other):
        squeezed.admit(request, [])
        assert squeezed.allocate(request, 2 * BLOCK)
    first.num_computed_tokens = 2 * BLOCK
    squeezed.publish(first)
    held = list(first.block_ids)
    squeezed.free(first)
    squeezed.free(other)
    hits = squeezed.match_prefix(make_request(0, 1, prompt=prompt))
    assert hits[:2] == held and len(hits) == 4  # room for 2 restores, into the other request's blocks
    squeezed.check_integrity([])
    kv.tier.close()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(prefix_cache_disk_gb=1.0), "needs --prefix-cache-dir"),
        (dict(prefix_cache_dir="D", enable_prefix_reuse=False), "prefix reuse is off"),
        (dict(prefix_cache_dir="D", prefix_cache_disk_gb=0.0), "must be > 0, got 0"),
        (dict(prefix_cache_dir="FILE"), "is not a directory"),
    ],
)
def test_bad_disk_tier_options_are_refused_by_name(tmp_path: Path, settings: dict, message: str) -> None:
    (tmp_path / "FILE").write_text("")
    given = {k: str(tmp_path / v) if k == "prefix_cache_dir" else v for k, v in settings.items()}
    with pytest.raises(LimitExceededError, match=message) as raised:
        prefix_disk_tier_config(RuntimeSettings(**given))
    assert "--prefix-cache-" in str(raised.value)


def test_disk_tier_options_become_its_config(tmp_path: Path) -> None:
    config = prefix_disk_tier_config(RuntimeSettings(prefix_cache_dir=str(tmp_path), prefix_cache_disk_gb=0.5))
    assert config == PrefixDiskTierConfig(tmp_path, GB // 2)
    assert prefix_disk_tier_config(RuntimeSettings()) is None


def test_a_file_removed_under_the_tier_is_a_miss(tmp_path: Path) -> None:
    """Another server on the directory pruned it after this one listed it: a miss, not an error."""
    tier = make_tier(tmp_path, make_pool())
    tier.spill(key(0), 0)
    tier.close()
    again = make_tier(tmp_path, make_pool())
    (tmp_path / again.file_name(key(0))).unlink()
    assert again.contains(key(0)) and not again.restore(key(0), 1)
    assert not again.contains(key(0)) and again.usage().rejected_files == 0
    again.close()


def test_an_unusable_directory_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    config = PrefixDiskTierConfig(tmp_path / "file" / "tier", GB)
    with pytest.raises(LimitExceededError, match=r"--prefix-cache-dir \(prefix_cache_dir\) .*file/tier"):
        make_block_tier(config, "build-a", make_pool(), BLOCK)


def test_a_windowed_manager_restores_through_the_tier_too(tmp_path: Path) -> None:
    """Every layer slides (window 6): the restored chain's slid-out entries are the null block,
    its live ones the restored blocks with the rows that were spilled, and the pool stays sound."""
    pool = torch.randn((2, 2, 9 * BLOCK, 3, 5))
    kv = WindowedKVCacheManager(9, SlidingWindowBlocks(window=6, block_size=BLOCK, max_num_tokens=32))
    kv.attach_tier(make_tier(tmp_path, pool))
    prompt = list(range(60, 60 + 4 * BLOCK + 1))
    first = make_request(0, 1, prompt=prompt)
    kv.admit(first, [])
    assert kv.allocate(first, len(prompt))
    live = [block_rows(pool, b).clone() for b in first.block_ids[2:4]]
    first.num_computed_tokens = len(prompt)
    kv.advance(first)
    kv.free(first)
    filler = make_request(8 * BLOCK, 1)
    kv.admit(filler, [])
    assert kv.allocate(filler, 8 * BLOCK) and kv.num_cached_blocks == 0
    pool.zero_()  # the filler's own K/V: what comes back must come from the tier
    kv.free(filler)
    second = make_request(0, 1, prompt=prompt)
    hits = kv.match_prefix(second)
    assert hits[:2] == [kv.null_block_id] * 2 and len(hits) == 4
    for block_id, rows in zip(hits[2:], live, strict=True):
        assert torch.equal(block_rows(pool, block_id), rows)
    kv.admit(second, hits)
    kv.check_integrity([second])
    kv.close()
