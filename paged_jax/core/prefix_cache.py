"""Automatic prefix caching, host side: vLLM V1's block hash chain and hash -> block map.

Only full blocks are hashed: hash(parent hash, the block's token ids, extra keys) with sha256, so a
hit can be trusted without comparing tokens. The map holds `(block_id, version)`, and drops an
entry as soon as the device hands its block out again (vLLM's `_maybe_evict_cached_block`), so it
never holds more entries than the pool has blocks; the version goes with each hit to the device,
which refuses a block of another version.
"""
from __future__ import annotations

import hashlib

import numpy as np

NONE_HASH = hashlib.sha256(b"paged-jax prefix cache").digest()


def hash_block(parent: bytes | None, tokens, extra: bytes | None = None) -> bytes:
    """The hash of one full block, chained to the hash of the block before it."""
    h = hashlib.sha256(parent or NONE_HASH)
    h.update(np.asarray(tokens, np.int64).tobytes())
    if extra:  # length-prefixed so that no token bytes can be read as extra keys
        h.update(len(extra).to_bytes(8, "little") + extra)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        first_key: bytes | None = None) -> None:
    """Append the hashes of every newly completed full block of `token_ids` (vLLM's incremental
    request block hasher). `first_key` (Request.block_hash_key: a cache salt, a LoRA adapter) is an
    extra key of the first block only, which keeps the chains apart from the start."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = first_key if i == 0 else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))


class PrefixCache:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.entries: dict[bytes, tuple[int, int]] = {}  # hash -> (block_id, version)
        self.hash_of: dict[int, bytes] = {}  # block_id -> the hash whose entry it holds
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached (prefix_cache_hits)

    def candidates(self, hashes: list[bytes], max_blocks: int) -> list[tuple[int, int]]:
        """The entries of the longest run of leading hashes present in the map."""
        found = []
        for h in hashes[:max_blocks] if self.enabled else ():
            entry = self.entries.get(h)
            if entry is None:
                break
            found.append(entry)
        return found

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enabled:
            self.queries += num_tokens
            self.hits += num_hit_tokens

    def insert(self, block_hash: bytes, block_id: int, version: int) -> bool:
        """Map a newly filled block; False when the map already holds this very block."""
        if not self.enabled or self.entries.get(block_hash) == (block_id, version):
            return False
        if block_hash in self.entries:  # computed twice (two requests at once): the newer block wins
            del self.hash_of[self.entries[block_hash][0]]
        self.evict([block_id])
        self.entries[block_hash] = (block_id, version)
        self.hash_of[block_id] = block_hash
        return True

    def evict(self, block_ids) -> None:
        """These blocks were handed out again: their entries are gone."""
        for block_id in block_ids:
            block_hash = self.hash_of.pop(block_id, None)
            if block_hash is not None:
                del self.entries[block_hash]

    def reset(self) -> None:
        self.entries.clear()
        self.hash_of.clear()
