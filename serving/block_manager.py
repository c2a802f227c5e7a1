"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, block tables, prefix caching.

A block holds `block_size` tokens' keys and values for every layer. A sequence's block table maps
its logical block i to a physical block. Full blocks whose KV has been computed are hashed by a
chain over their tokens (hash of the previous block + these tokens), so a later request with the
same prefix reuses them: reference counts say how many sequences share a block, and a freed block
keeps its hash until it is handed out again, so a prefix can be revived after its owner finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # an ordered set, oldest first
        self.hash_to_block_id: dict[int, int] = {}
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
        """Hash the blocks that became full of computed KV in the last step, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        first = num_computed_before // self.block_size
        last = seq.num_computed_tokens // self.block_size  # blocks [first, last) are now full
        for i in range(first, last):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            prev = self.blocks[seq.block_table[i - 1]].hash if i > 0 else None
            if i > 0 and prev is None:
                return
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block.hash, block.token_ids = chain_hash(prev, tokens), tokens
            self.hash_to_block_id.setdefault(block.hash, block.block_id)

    # ---- internals -----------------------------------------------------------------------------
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Physical blocks holding this sequence's leading full blocks. The last token is never taken
        from the cache: its logits are needed to sample the next token. Scoring requests (prompt
        logprobs) need every prompt position's logits, so they take nothing from the cache."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        hits: list[int] = []
        prev: int | None = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = chain_hash(prev, tokens)
            block_id = self.hash_to_block_id.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id
