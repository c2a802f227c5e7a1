"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, block tables, prefix caching.

A block holds `block_size` tokens' keys and values for every layer. A sequence's block table maps
its logical block i to a physical block. Full blocks whose KV has been computed are indexed by a
SHA-256 chain: block i's digest covers block i-1's digest and block i's token ids, and the chain
starts from a digest of the request's cache scope (its tenant and `cache_salt`, or only the salt when
the scope is global), so one scope never finds another's blocks. A later request of the same scope
with the same prefix reuses them: reference counts say how many sequences share a block, and a freed
block keeps its digest until it is handed out again, so a prefix can be revived after its owner
finished.

A hit is taken only when the candidate's digest, its own token ids and its parent (the physical block
and generation the previous hit resolved to, or the scope for a first block) all match, so even a
digest collision could never make a block reuse KV computed under another context.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

from serving.core.sequence import Sequence

PREFIX_CACHE_SCOPES = ("tenant", "global")
ROOT_DOMAIN = b"quantgate/prefix-cache/v1\0"

Parent = tuple[int, int] | bytes  # (block id, generation) of the previous block, or a first block's scope root


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    parent: Parent | None = None
    generation: int = 0  # bumped each time the block is handed out afresh: stale children stop matching


def scope_root(scope: str, tenant: str, cache_salt: str | None) -> bytes:
    """The digest a sequence's chain starts from: who may share its prefix blocks."""
    key = ["global", cache_salt] if scope == "global" else ["tenant", tenant, cache_salt]
    return hashlib.sha256(ROOT_DOMAIN + json.dumps(key).encode()).digest()


def block_digest(parent: bytes, token_ids: Tokens[int]) -> bytes:
    """SHA-256 over the parent's digest and the block's token ids as little-endian uint32."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_cache_scope: str = "tenant"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"unknown prefix-cache scope {prefix_cache_scope!r}; choose one of "
                             f"{list(PREFIX_CACHE_SCOPES)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_scope = prefix_cache_scope
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # an ordered set, oldest first
        self.hash_to_block_id: dict[bytes, int] = {}
        self.prefix_cache_hit_tokens = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_for_prompt(self, seq: Sequence) -> int:
        """Blocks admission must take from the free list (cache hits on live blocks cost nothing)."""
        hits = self._prefix_hits(seq)
        live_hits = sum(1 for block_id in hits if self.blocks[block_id].ref_count > 0)
        return self.blocks_needed(seq.num_tokens) - live_hits

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._prefix_hits(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_cache_hit_tokens += seq.num_cached_tokens
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free_block())

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow a running sequence's table so `num_new_tokens` more tokens have a slot."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finish, abort or preemption). Hashed blocks stay revivable."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def mark_computed(self, seq: Sequence, num_computed_before: int) -> None:
        """Index the blocks that became full of computed KV in the last step, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        first = num_computed_before // self.block_size
        last = seq.num_computed_tokens // self.block_size  # blocks [first, last) are now full
        digests = self._digests(seq, last)
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            if i > 0 and self.blocks[seq.block_table[i - 1]].hash is None:
                return
            block.hash, block.token_ids = digests[i], self._block_tokens(seq, i)
            block.parent = self._parent_of(seq, i)
            self._index(block, seq, i)

    # ---- internals -----------------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Physical blocks holding this sequence's leading full blocks. The last token is never taken
        from the cache: its logits are needed to sample the next token. Scoring requests (prompt
        logprobs) need every prompt position's logits, so they take nothing from the cache."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        count = (seq.num_tokens - 1) // self.block_size
        digests = self._digests(seq, count)
        hits: list[int] = []
        for i in range(count):
            block_id = self.hash_to_block_id.get(digests[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            parent = seq.cache_root if i == 0 else (hits[-1], self.blocks[hits[-1]].generation)
            if block.hash != digests[i] or block.parent != parent or block.token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def _index(self, block: Block, seq: Sequence, i: int) -> None:
        """Index a newly hashed block unless an equal block already continues the indexed chain, so a walk
        from the root always meets consistent parents, also when two sequences computed the same prefix."""
        current = self.hash_to_block_id.get(block.hash)
        if current is not None:
            if i == 0:
                expected: Parent | None = seq.cache_root
            else:
                above = self.hash_to_block_id.get(seq.block_hashes[i - 1])
                expected = None if above is None else (above, self.blocks[above].generation)
            other = self.blocks[current]
            if other.hash == block.hash and expected is not None and other.parent == expected:
                return
        self.hash_to_block_id[block.hash] = block.block_id

    def _digests(self, seq: Sequence, count: int) -> list[bytes]:
        """The chain digests of the sequence's first `count` full blocks, memoised on it (tokens only grow)."""
        if seq.cache_root is None:
            seq.cache_root = scope_root(self.prefix_cache_scope, seq.tenant, seq.cache_salt)
        digests = seq.block_hashes
        for i in range(len(digests), count):
            digests.append(block_digest(digests[i - 1] if i else seq.cache_root, self._block_tokens(seq, i)))
        return digests

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _parent_of(self, seq: Sequence, i: int) -> Parent:
        if i == 0:
            return seq.cache_root
        parent = self.blocks[seq.block_table[i - 1]]
        return parent.block_id, parent.generation

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.parent, block.ref_count = None, (), None, 1
        block.generation += 1
        return block_id
