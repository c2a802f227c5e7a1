from serving.core.block_manager import BlockManager
from serving.core.sampling_params import SamplingParams
from serving.core.sequence import Sequence


def seq(tokens: list[int], rid: str = "r", **params) -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(**params))


def test_allocate_counts_blocks_exactly():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(list(range(9)))  # 9 tokens -> 3 blocks
    bm.allocate(s)
    assert len(s.block_table) == 3
    assert bm.num_free_blocks == 7
    s.num_computed_tokens = 9
    s.token_ids.append(100)  # 10th token fits in block 3
    assert bm.can_append(s, 1)
    bm.append_slots(s, 1)
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    s.token_ids += [101, 102, 103]
    bm.append_slots(s, 1)  # 13th token needs a 4th block
    assert len(s.block_table) == 4 and bm.num_free_blocks == 6
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_prefix_sharing_reuses_computed_full_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)), "a")  # blocks: [0-3] [4-7] [8,9]
    bm.allocate(a)
    a.num_computed_tokens = 10
    bm.mark_computed(a, 0)  # two full blocks hashed
    b = seq(list(range(8)) + [50, 51, 52], "b")
    assert bm.num_new_blocks_for_prompt(b) == 1  # 3 blocks, 2 shared with a live sequence
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.prefix_cache_hit_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 10 - 4
    bm.free(a)
    assert bm.num_free_blocks == 10 - 3
    bm.free(b)
    assert bm.num_free_blocks == 10
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_freed_prefix_is_revived_until_the_block_is_reused():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.allocate(a)
    a.num_computed_tokens = 5
    bm.mark_computed(a, 0)
    bm.free(a)
    b = seq([1, 2, 3, 4, 9], "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    bm.free(b)
    # a different sequence takes every block: the cached hashes are evicted
    c = seq([7, 7, 7, 7, 7, 7, 7, 7], "c")
    bm.allocate(c)
    bm.free(c)
    d = seq([1, 2, 3, 4, 5], "d")
    bm.allocate(d)
    assert d.num_cached_tokens == 0


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(8)), "a")
    bm.allocate(a)
    a.num_computed_tokens = 8
    bm.mark_computed(a, 0)
    b = seq(list(range(8)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 4  # the last block is recomputed so its last token yields logits
    assert b.num_computed_tokens < b.num_tokens


def test_scoring_requests_skip_the_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(9)), "a")
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.mark_computed(a, 0)
    b = seq(list(range(9)), "b", prompt_logprobs=0)
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(list(range(9)), "a")
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.mark_computed(a, 0)
    b = seq(list(range(9)), "b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
