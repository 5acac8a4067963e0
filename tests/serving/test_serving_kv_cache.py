"""KVBlockManager: block accounting, refusal when full, no over-allocation."""

import pytest

from slicesched.serving.kv_cache import KVBlockManager, blocks_for


def test_blocks_for_floors_to_whole_blocks() -> None:
    # 1 MiB at 64 B/token, 16-token blocks = 1024 B/block -> 1024 blocks; a partial block is dropped
    assert blocks_for(2**20, 64, 16) == 1024
    assert blocks_for(2**20 + 1000, 64, 16) == 1024
    assert blocks_for(-5, 64, 16) == 0


def test_allocate_rounds_up_to_blocks_and_grows() -> None:
    kv = KVBlockManager(num_blocks=10, block_tokens=16)
    assert kv.allocate("a", 17)
    assert kv.held("a") == 2 and kv.used_blocks == 2 and kv.num_free == 8
    assert kv.allocate("a", 32)  # still 2 blocks: no change
    assert kv.used_blocks == 2
    assert kv.allocate("a", 33)
    assert kv.held("a") == 3 and kv.used_blocks == 3


def test_allocate_returns_false_when_full_and_changes_nothing() -> None:
    kv = KVBlockManager(num_blocks=4, block_tokens=4)
    assert kv.allocate(1, 12)  # 3 blocks
    assert not kv.can_allocate(8)
    assert kv.allocate(2, 8) is False
    assert kv.held(2) == 0 and kv.used_blocks == 3
    assert kv.allocate(1, 20) is False  # growing by 2 blocks needs 2, only 1 free
    assert kv.held(1) == 3 and kv.used_blocks == 3
    assert kv.can_allocate(16, req_id=1) and kv.allocate(1, 16)
    assert kv.used_blocks == kv.num_blocks == 4 and kv.num_free == 0


def test_free_returns_blocks_to_the_pool() -> None:
    kv = KVBlockManager(num_blocks=4, block_tokens=4)
    kv.allocate(1, 16)
    assert kv.free(1) == 4
    assert kv.free(1) == 0
    assert kv.used_blocks == 0 and kv.allocate(2, 16)


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        KVBlockManager(num_blocks=4, block_tokens=0)
    with pytest.raises(ValueError):
        blocks_for(100, 0, 16)
