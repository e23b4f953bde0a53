"""KVCacheManager: allocation, ref counts, prefix reuse by hash chain, salt, LRU eviction."""

from __future__ import annotations

from fakes import make_request

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.sampling_params import SamplingParams


def computed(kv: KVCacheManager, request, num_tokens: int) -> None:
    """Pretend the engine computed `num_tokens` more tokens of the request."""
    assert kv.allocate(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.publish(request)


def test_allocate_and_free_return_every_block() -> None:
    """free + used == total before, during and after; freed blocks are free again."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request(10, 4), make_request(5, 4)
    kv.admit(a, []), kv.admit(b, [])
    assert kv.allocate(a, 10) and kv.allocate(b, 5)
    assert (len(a.block_ids), len(b.block_ids), kv.num_free_blocks) == (3, 2, 3)
    kv.check_integrity([a, b])
    kv.free(a), kv.free(b)
    assert kv.num_free_blocks == 8
    kv.check_integrity([])


def test_allocate_refuses_when_short_without_side_effects() -> None:
    """A request needing more blocks than are free gets none."""
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request(12, 1)
    kv.admit(a, [])
    assert not kv.allocate(a, 12)
    assert a.block_ids == [] and kv.num_free_blocks == 2


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token() -> None:
    """A second request with the same 12-token prompt reuses 2 full blocks, computes the rest."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 22))
    first = make_request(0, 4, prompt=prompt)
    kv.admit(first, kv.match_prefix(first))
    computed(kv, first, 12)
    second = make_request(0, 4, prompt=prompt)
    hits = kv.match_prefix(second)
    assert hits == first.block_ids[:2]  # the 3rd block would leave nothing to compute
    kv.admit(second, hits)
    assert second.num_computed_tokens == 8 and kv.blocks[hits[0]].ref_count == 2
    kv.check_integrity([first, second])


def test_prefix_chain_stops_at_first_difference() -> None:
    """Hashes chain: a changed token in block 1 makes block 2 a miss even if identical."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request(0, 1, prompt=list(range(16)))
    kv.admit(first, [])
    computed(kv, first, 16)
    other = list(range(16))
    other[5] = 99
    second = make_request(0, 1, prompt=other)
    assert kv.match_prefix(second) == first.block_ids[:1]


def test_cache_salt_separates_tenants() -> None:
    """Same tokens, different cache_salt: no sharing."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    a = make_request(0, 1, prompt=prompt, params=SamplingParams(max_tokens=1, cache_salt="tenant-a"))
    kv.admit(a, [])
    computed(kv, a, 12)
    b = make_request(0, 1, prompt=prompt, params=SamplingParams(max_tokens=1, cache_salt="tenant-b"))
    assert kv.match_prefix(b) == []
    c = make_request(0, 1, prompt=prompt, params=SamplingParams(max_tokens=1, cache_salt="tenant-a"))
    assert len(kv.match_prefix(c)) == 2


def test_freed_cached_blocks_survive_until_free_blocks_run_out() -> None:
    """Unreferenced cached blocks are evicted only when never-used blocks are gone, LRU first."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request(0, 1, prompt=list(range(8)))
    kv.admit(a, [])
    computed(kv, a, 8)
    kv.free(a)
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 6
    filler = make_request(16, 1)
    kv.admit(filler, [])
    assert kv.allocate(filler, 16)  # 4 never-used blocks: the cached ones survive
    assert kv.num_cached_blocks == 2
    again = make_request(0, 1, prompt=list(range(8)) + [1])
    assert len(kv.match_prefix(again)) == 2
    more = make_request(4, 1)
    kv.admit(more, [])
    assert kv.allocate(more, 4)  # now one cached block must go
    assert kv.num_cached_blocks == 1
    kv.check_integrity([filler, more])


def test_disabled_prefix_reuse_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_reuse=False)
    a = make_request(0, 1, prompt=list(range(9)))
    kv.admit(a, [])
    computed(kv, a, 9)
    assert kv.match_prefix(make_request(0, 1, prompt=list(range(9)))) == []


def test_prefix_keys_are_sha256_chains_salted_per_tenant() -> None:
    """Equal blocks chain to equal keys; any earlier difference, or another salt, changes them."""
    from ifb.runtime.prefix_hash import prefix_block_keys

    tokens = list(range(40))
    keys = prefix_block_keys(tokens, 16, None)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert prefix_block_keys(tokens[:32], 16, None) == keys
    assert prefix_block_keys([99] + tokens[1:], 16, None)[1] != keys[1]  # the chain carries the parent
    assert prefix_block_keys(tokens, 16, "tenant-a") != keys
    assert prefix_block_keys(tokens, 16, "tenant-a") != prefix_block_keys(tokens, 16, "tenant-b")
    resumed = prefix_block_keys(tokens, 16, None, start=1, parent=keys[0])
    assert resumed == keys[1:]


def test_lent_blocks_come_back_first_in_line_and_cached_blocks_survive_a_short_loan() -> None:
    """Calibration in an idle turn borrows blocks (KVCacheManager.lend): taken as an allocation
    takes them (never-used blocks first), given back to the free list's head, so the next loan or
    request reuses them before evicting a cached prefix."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    first = make_request(0, 4, prompt=list(range(10, 18)))
    kv.admit(first, kv.match_prefix(first))
    computed(kv, first, 8)  # two full blocks, published
    cached = list(first.block_ids)
    kv.free(first)
    assert kv.num_cached_blocks == 2
    lent = kv.lend(4)
    assert set(lent).isdisjoint(cached) and kv.num_cached_blocks == 2
    kv.take_back(lent)
    kv.check_integrity([])
    assert kv.lend(4) == lent  # the same never-cached blocks again, no cached block evicted
    assert kv.num_cached_blocks == 2
