"""Prefix caching, as vLLM's automatic prefix caching does it: full KV blocks are kept, keyed by a
hash of their tokens and of every block before them, shared by the requests of a tenant (one
engine) that start with the same tokens, reference-counted, and evicted least recently used when
free blocks run out.

    keys = prefix_keys(trace_hashes, 512, 16, prompt_tokens)   # one key per full 16-token block
    kv = PrefixCachingKV(num_blocks, 16)
    hit = kv.acquire_prefix(req_id, keys, num_tokens)          # at admission: tokens cached
    kv.commit_prefix(req_id, keys, computed_tokens)            # after a step: blocks now full

What keys stand for: a trace that publishes prefix hashes (Mooncake: one hash per 512-token block
of the prompt, equal hashes meaning equal prefixes up to and including that block) gives each
16-token engine block the key (hash of its 512-token block, its index inside it), chained with
the keys before it, so two requests share a block exactly when the trace says their prompts
agree up to its end. Only blocks the hashes cover and the prompt fills are cacheable; a request
always computes at least its last prompt token (its first output needs it), as vLLM does.

Counting (the simulator needs counts, not block ids): a block is either free, private to one
request, or cached under its key (held by requests, or held by none and evictable). `used_blocks`
counts private and cached blocks, evictable ones too: they hold KV and stay in the memory ledger
until evicted; `num_free` counts what an allocation may take, evictable blocks included.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from slicesched.serving.kv_cache import BlockIds, KVBlockManager

#: Tokens per prefix hash in Mooncake's traces (the only published traces with prefix hashes).
MOONCAKE_HASH_BLOCK_TOKENS = 512


def prefix_keys(hashes: Sequence[int], hash_block_tokens: int, block_tokens: int, prompt_tokens: int
                ) -> tuple[int, ...]:
    """One key per full engine block of the prompt that the hashes cover (see the module
    docstring); each key chains the ones before it."""
    if hash_block_tokens % block_tokens:
        raise ValueError(f"a hash block of {hash_block_tokens} tokens is not whole {block_tokens}-token blocks")
    per_hash = hash_block_tokens // block_tokens
    n = min(len(hashes) * hash_block_tokens, prompt_tokens) // block_tokens
    keys, prev = [], 0
    for j in range(n):
        prev = hash((prev, int(hashes[j // per_hash]), j % per_hash))
        keys.append(prev)
    return tuple(keys)


def key_prefixes(requests: Sequence, hashes: Sequence, block_tokens: int,
                 hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS) -> None:
    """Give each request the keys of its prompt blocks from its trace row's prefix hashes."""
    for req, h in zip(requests, hashes):
        if h is not None and len(h):
            req.prefix_keys = prefix_keys(h, hash_block_tokens, block_tokens, req.prompt_tokens)


class PrefixCachingKV(KVBlockManager):
    """A `KVBlockManager` that shares full prompt blocks between requests (see the module
    docstring). Also counts, per engine, the prompt tokens found cached at admission."""

    __slots__ = ("_refs", "_evictable", "_shared", "hit_tokens", "lookup_tokens", "evictions")

    def __init__(self, num_blocks: int, block_tokens: int = 16) -> None:
        super().__init__(num_blocks, block_tokens)
        self._refs: dict[int, int] = {}  # cached key -> requests holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held by none, least recent first
        self._shared: dict[Hashable, list[int]] = {}  # request -> the cached keys it holds, in order
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.evictions = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.num_blocks - self._used + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    def held(self, req_id: Hashable) -> int:
        return self._held.get(req_id, 0) + len(self._shared.get(req_id, ()))

    def can_allocate(self, n_tokens: int, req_id: Hashable | None = None) -> bool:
        return self.blocks_needed(n_tokens) - self.held(req_id) <= self.num_free

    def allocate(self, req_id: Hashable, n_tokens: int) -> bool:
        extra = self.blocks_needed(n_tokens) - self.held(req_id)
        if extra <= 0:
            return True
        if extra > self.num_free:
            return False
        self._evict(extra - (self.num_blocks - self._used))
        self._held[req_id] = self._held.get(req_id, 0) + extra
        self._used += extra
        return True

    def free(self, req_id: Hashable) -> int:
        """Release the request's private blocks and its hold on cached ones (evictable once no
        request holds them, most recently used last)."""
        n = self._held.pop(req_id, 0)
        self._used -= n
        keys = self._shared.pop(req_id, [])
        for k in keys:
            self._refs[k] -= 1
            if self._refs[k] == 0:
                self._evictable[k] = None
        return n + len(keys)

    def lend(self, n: int) -> bool:
        """Lend `n` blocks, evicting cached ones nobody holds if the free ones do not suffice."""
        if n < 0 or n > self.num_free:
            return False
        self._evict(n - (self.num_blocks - self._used))
        return super().lend(n)

    # ---- the cache ----------------------------------------------------------------------------
    def _cached_run(self, keys: Sequence[int], num_tokens: int) -> list[int]:
        """The leading keys found cached, leaving at least one of `num_tokens` to compute."""
        got: list[int] = []
        for k in keys[:(num_tokens - 1) // self.block_tokens]:
            if k not in self._refs:
                break
            got.append(k)
        return got

    def peek_prefix(self, keys: Sequence[int], num_tokens: int) -> int:
        """Tokens `acquire_prefix` would find cached now, holding nothing (a router's question)."""
        return len(self._cached_run(keys, num_tokens)) * self.block_tokens

    def acquire_prefix(self, req_id: Hashable, keys: Sequence[int], num_tokens: int) -> int:
        """At admission of a request holding nothing: hold the longest cached run of its keys
        (leaving at least one token to compute) and return the tokens it covers."""
        got = self._cached_run(keys, num_tokens)
        self.lookup_tokens += min(len(keys), (num_tokens - 1) // self.block_tokens) * self.block_tokens
        if not got:
            return 0
        for k in got:
            if self._refs[k] == 0:
                del self._evictable[k]
            self._refs[k] += 1
        self._shared[req_id] = got
        self.hit_tokens += len(got) * self.block_tokens
        return len(got) * self.block_tokens

    def commit_prefix(self, req_id: Hashable, keys: Sequence[int], computed_tokens: int) -> None:
        """The request's KV now covers `computed_tokens`: its private blocks that are full and
        keyed become cached, in order (stopping at a key another request cached first, whose
        block this one keeps private)."""
        shared = self._shared.setdefault(req_id, [])
        full = min(computed_tokens // self.block_tokens, len(keys))
        while len(shared) < full and self._held.get(req_id, 0) > 0:
            k = keys[len(shared)]
            if k in self._refs:
                break
            self._refs[k] = 1
            shared.append(k)
            self._held[req_id] -= 1  # a private block becomes the cached one: still used
        if not shared:
            del self._shared[req_id]

    def _evict(self, n: int) -> None:
        """Free `n` evictable blocks, least recently used first."""
        for _ in range(max(n, 0)):
            k, _ = self._evictable.popitem(last=False)
            del self._refs[k]
            self._used -= 1
            self.evictions += 1
            self._evicted(k)

    def _evicted(self, key: int) -> None:
        """A cached block left the cache (a subclass naming blocks frees its id)."""


class PagedPrefixCachingKV(PrefixCachingKV):
    """`PrefixCachingKV` naming its blocks, for a backend whose KV lives in real tensors: a
    request's block table is its cached prefix blocks (shared, by key) then its private ones; a
    private block that fills and becomes cached keeps its id (and its KV) under its key."""

    __slots__ = ("_private", "_key_block")

    def __init__(self, num_blocks: int, block_tokens: int = 16) -> None:
        super().__init__(num_blocks, block_tokens)
        self._ids = BlockIds(num_blocks)
        self._private: dict[Hashable, list[int]] = {}
        self._key_block: dict[int, int] = {}

    def block_table(self, req_id: Hashable) -> tuple[int, ...]:
        shared = [self._key_block[k] for k in self._shared.get(req_id, ())]
        return tuple(shared + self._private.get(req_id, []))

    def allocate(self, req_id: Hashable, n_tokens: int) -> bool:
        have = self._held.get(req_id, 0)
        if not super().allocate(req_id, n_tokens):  # evicts first where it must (`_evicted`)
            return False
        self._private.setdefault(req_id, []).extend(self._ids.take(self._held.get(req_id, 0) - have))
        return True

    def free(self, req_id: Hashable) -> int:
        self._ids.give(self._private.pop(req_id, []))
        return super().free(req_id)

    def commit_prefix(self, req_id: Hashable, keys: Sequence[int], computed_tokens: int) -> None:
        before = len(self._shared.get(req_id, ()))
        super().commit_prefix(req_id, keys, computed_tokens)
        private = self._private.get(req_id, [])
        for k in self._shared.get(req_id, [])[before:]:  # its first private blocks, now cached: same ids, same KV
            self._key_block[k] = private.pop(0)

    def _evicted(self, key: int) -> None:
        self._ids.give([self._key_block.pop(key)])


def token_keys(ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """One key per full block of a prompt's token ids, chaining the blocks before it (what a
    live request's cache keys are: equal keys mean equal tokens up to that block's end)."""
    keys, prev = [], 0
    for j in range(len(ids) // block_tokens):
        prev = hash((prev, tuple(ids[j * block_tokens:(j + 1) * block_tokens])))
        keys.append(prev)
    return tuple(keys)
