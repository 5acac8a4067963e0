"""Paged KV-cache block accounting for one tenant engine.

The caller (replay setup) sizes the pool from the device memory left after weights with
``blocks_for`` and gives one ``KVBlockManager`` to each ``TenantEngine``. The engine is the only
writer: it grows a request's allocation before each step and frees it on finish or preemption.
Running out is an ordinary outcome that the engine answers by preempting, so ``allocate`` returns
False instead of raising (as vLLM's ``kv_cache_manager`` returns None).

Only block counts are kept, not block ids: nothing downstream needs physical block numbers, and
counts keep every call O(1). Blocks are whole, so a request holding ``n`` tokens uses
``ceil(n / block_tokens)`` blocks, which is the fragmentation paging really has.
"""

from __future__ import annotations

from collections.abc import Hashable


def blocks_for(capacity_bytes: float, kv_bytes_per_token: float, block_tokens: int = 16) -> int:
    """Number of whole KV blocks that fit in ``capacity_bytes`` (memory left after weights)."""
    if kv_bytes_per_token <= 0 or block_tokens <= 0:
        raise ValueError("kv_bytes_per_token and block_tokens must be positive")
    if capacity_bytes <= 0:
        return 0
    return int(capacity_bytes // (kv_bytes_per_token * block_tokens))


class KVBlockManager:
    """A fixed pool of ``num_blocks`` blocks of ``block_tokens`` tokens, allocated per request."""

    __slots__ = ("num_blocks", "block_tokens", "_held", "_used", "_ids")

    def __init__(self, num_blocks: int, block_tokens: int = 16) -> None:
        if num_blocks < 0 or block_tokens <= 0:
            raise ValueError(f"need num_blocks >= 0 and block_tokens > 0, got {num_blocks}, {block_tokens}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._held: dict[Hashable, int] = {}
        self._used = 0
        self._ids: BlockIds | None = None  # a pool naming its blocks (real KV) keeps their free and lent ids

    def lend(self, n: int) -> bool:
        """Shrink the pool by ``n`` free blocks (memory lent to a guest on this device); False,
        and no change, if fewer than ``n`` blocks are free."""
        if n < 0 or n > self.num_blocks - self._used:
            return False
        self.num_blocks -= n
        if self._ids is not None:
            self._ids.lend(n)
        return True

    def reclaim(self, n: int) -> None:
        """Take back ``n`` blocks lent earlier."""
        self.num_blocks += n
        if self._ids is not None:
            self._ids.reclaim(n)

    @property
    def num_ids(self) -> int:
        """Block ids in use anywhere: the pool's blocks, lent ones included (ids stay below it)."""
        return self.num_blocks + (len(self._ids.lent) if self._ids is not None else 0)

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` tokens."""
        return -(-n_tokens // self.block_tokens)

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._used

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    def held(self, req_id: Hashable) -> int:
        """Blocks ``req_id`` holds now (0 if none)."""
        return self._held.get(req_id, 0)

    def can_allocate(self, n_tokens: int, req_id: Hashable | None = None) -> bool:
        """Whether ``allocate(req_id, n_tokens)`` would succeed now (a new request if None)."""
        extra = self.blocks_needed(n_tokens) - self._held.get(req_id, 0)
        return extra <= self.num_blocks - self._used

    def allocate(self, req_id: Hashable, n_tokens: int) -> bool:
        """Make ``req_id`` hold room for ``n_tokens`` tokens in total (grows, never shrinks).

        Returns False and changes nothing when the free blocks do not suffice.
        """
        need = -(-n_tokens // self.block_tokens)
        have = self._held.get(req_id, 0)
        if need <= have:
            return True
        extra = need - have
        if extra > self.num_blocks - self._used:
            return False
        self._held[req_id] = need
        self._used += extra
        return True

    def free(self, req_id: Hashable) -> int:
        """Release every block of ``req_id``; returns how many (0 if it held none)."""
        n = self._held.pop(req_id, 0)
        self._used -= n
        return n

    def acquire_prefix(self, req_id: Hashable, keys: tuple[int, ...], num_tokens: int) -> int:
        """Tokens of the request's prompt found cached (none: this pool caches no prefixes;
        `serving.prefix.PrefixCachingKV` does)."""
        return 0

    def peek_prefix(self, keys: tuple[int, ...], num_tokens: int) -> int:
        """Tokens of such a prompt `acquire_prefix` would find cached now (none here)."""
        return 0

    def commit_prefix(self, req_id: Hashable, keys: tuple[int, ...], computed_tokens: int) -> None:
        """Offer the request's full blocks for sharing (this pool keeps none)."""
        return None

    def __repr__(self) -> str:
        return (f"KVBlockManager(num_blocks={self.num_blocks}, block_tokens={self.block_tokens}, "
                f"used={self._used}, requests={len(self._held)})")


class BlockIds:
    """The ids of a pool's blocks that no request holds: free ones (the lowest handed out
    first) and lent ones (to another replica's pool, back on reclaim)."""

    __slots__ = ("free", "lent")

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.lent: list[int] = []

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def give(self, ids: list[int]) -> None:
        self.free.extend(reversed(ids))

    def lend(self, n: int) -> None:
        self.lent += self.take(n)

    def reclaim(self, n: int) -> None:
        self.free += [self.lent.pop() for _ in range(n)]


class PagedKVBlockManager(KVBlockManager):
    """A `KVBlockManager` that also names the blocks: each request holds a table of block ids
    into the pool, as vLLM's block manager gives its model runner. Real serving needs them (the
    KV lives in real tensors indexed by these ids); the simulator needs counts alone."""

    __slots__ = ("_tables",)

    def __init__(self, num_blocks: int, block_tokens: int = 16) -> None:
        super().__init__(num_blocks, block_tokens)
        self._ids = BlockIds(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}

    def block_table(self, req_id: Hashable) -> tuple[int, ...]:
        return tuple(self._tables.get(req_id, ()))

    def allocate(self, req_id: Hashable, n_tokens: int) -> bool:
        have = self._held.get(req_id, 0)
        if not super().allocate(req_id, n_tokens):
            return False
        self._tables.setdefault(req_id, []).extend(self._ids.take(self._held.get(req_id, 0) - have))
        return True

    def free(self, req_id: Hashable) -> int:
        self._ids.give(self._tables.pop(req_id, []))
        return super().free(req_id)
