"""Tenants that cannot see each other: a prefix cached for one scope is never reused by another, hits are
verified beyond the digest, and /metrics answers only to the metrics key when tenants are configured."""

from __future__ import annotations

import hashlib
import random
import struct

import httpx
import pytest
from engine_helpers import hf_greedy
from server_fixtures import one_torch_thread, running_server, tiny_engine

from serving import LLMEngine, SamplingParams
from serving.core.block_manager import BlockManager, block_digest, scope_root
from serving.core.sequence import Sequence
from serving.http.tenants import parse_tenants

BLOCK = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
KEYS = {"sk-team-a-0001": "a", "sk-team-b-0001": "b"}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(engine: LLMEngine, prompt: list[int], **request) -> tuple[list[int], int, set[int]]:
    """Generate one request; (output ids, prompt tokens taken from the cache, the blocks it held)."""
    rid = engine.add_request(prompt, GREEDY, **request)
    held: set[int] = set()
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.num_cached_tokens, held
        if rid in engine.sequences:
            held |= set(engine.sequences[rid].block_table)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    with one_torch_thread():
        yield {scope: tiny_engine(tiny_model_dir, block_size=BLOCK, prefix_cache_scope=scope)
               for scope in ("tenant", "global")}


def cached_blocks(engine: LLMEngine) -> set[int]:
    return {b.block_id for b in engine.block_manager.blocks if b.hash is not None}


# ---- the engine --------------------------------------------------------------------------------
def test_another_tenant_never_reuses_a_cached_prefix_but_its_owner_does(engines, tiny_model_dir):
    engine = engines["tenant"]
    prompt = tokens(41, seed=1)  # ten full blocks may come from the cache, the last token never does
    expected = hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)
    out, cached, _ = run(engine, prompt, tenant="a")
    assert (out, cached) == (expected, 0)
    a_blocks = cached_blocks(engine)
    hits = engine.stats().prefix_cache_hit_tokens

    out, cached, held = run(engine, prompt, tenant="b")
    assert (out, cached) == (expected, 0)
    assert engine.stats().prefix_cache_hit_tokens == hits  # no hit counted for B
    assert held.isdisjoint(a_blocks)  # B's KV was computed afresh in other blocks
    assert a_blocks <= cached_blocks(engine)  # A's blocks stayed cached meanwhile: not reused is not evicted

    out, cached, held = run(engine, prompt, tenant="a")
    assert (out, cached) == (expected, 40)  # A keeps its own reuse
    assert engine.stats().prefix_cache_hit_tokens == hits + 40
    assert len(held & a_blocks) == 10


def test_cache_salt_separates_requests_of_one_tenant(engines, tiny_model_dir):
    engine = engines["tenant"]
    prompt = tokens(33, seed=2)
    expected = hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)
    assert run(engine, prompt, tenant="a", cache_salt="alice")[:2] == (expected, 0)
    assert run(engine, prompt, tenant="a", cache_salt="bob")[:2] == (expected, 0)
    assert run(engine, prompt, tenant="a")[:2] == (expected, 0)  # no salt is a scope of its own
    assert run(engine, prompt, tenant="a", cache_salt="alice")[:2] == (expected, 32)
    assert run(engine, prompt, tenant="b", cache_salt="alice")[:2] == (expected, 0)  # a salt never crosses tenants


def test_global_scope_shares_across_tenants_unless_salted(engines, tiny_model_dir):
    engine = engines["global"]
    prompt = tokens(37, seed=3)
    expected = hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)
    assert run(engine, prompt, tenant="a")[:2] == (expected, 0)
    assert run(engine, prompt, tenant="b")[:2] == (expected, 36)  # deliberate sharing: the leak is there
    assert run(engine, prompt, tenant="b", cache_salt="private")[:2] == (expected, 0)


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="unknown prefix-cache scope 'shared'"):
        BlockManager(8, 4, prefix_cache_scope="shared")


def test_chain_digests_are_sha256_over_parent_tokens_and_scope():
    root = scope_root("tenant", "a", None)
    assert root != scope_root("tenant", "b", None) != scope_root("tenant", "a", "s")
    assert scope_root("global", None, None) == scope_root("global", "anyone", None)  # global ignores the tenant
    first = block_digest(root, [1, 2, 3, 4])
    assert first == hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert block_digest(first, [5, 6, 7, 8]) != block_digest(block_digest(root, [9, 9, 9, 9]), [5, 6, 7, 8])


# ---- colliding digests -------------------------------------------------------------------------
def parent_blind(parent: bytes, token_ids) -> bytes:  # what an attacker wants: a block's digest without its context
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def constant(parent: bytes, token_ids) -> bytes:
    return b"\0" * 32


@pytest.mark.parametrize("digest", [parent_blind, constant], ids=["parent-blind", "constant"])
def test_colliding_digests_never_reuse_kv_of_another_context(tiny_model_dir, monkeypatch, digest):
    """X = A + C, then Z = B + D, then Y = B + C: with a digest that ignores the parent, Y's first C block
    collides with X's (computed after A, not B). The parent check refuses it: Y reuses only Z's B blocks
    and its output stays HF's. A verification by token ids alone (the old scheme) takes X's block."""
    monkeypatch.setattr("serving.core.block_manager.block_digest", digest)
    with one_torch_thread():
        engine = tiny_engine(tiny_model_dir, block_size=BLOCK)
    a, b, c, d = (tokens(8, seed=s) for s in (10, 11, 12, 13))
    tail = [7, 8, 9]
    for prompt in (a + c + tail, b + d + tail):
        assert run(engine, prompt)[0] == hf_greedy(tiny_model_dir, prompt, GREEDY.max_tokens)
    y = b + c + tail
    bm = engine.block_manager
    probe = Sequence("probe", None, y, GREEDY)
    collided = bm.hash_to_block_id.get(bm._digests(probe, 3)[2])  # what sits at the digest of Y's first C block
    assert collided is not None
    if digest is parent_blind:  # X's C block, computed after A: a real collision
        parent = bm.blocks[bm.blocks[collided].parent[0]]
        assert bm.blocks[collided].token_ids == tuple(c[:BLOCK]) and parent.token_ids == tuple(a[BLOCK:])
    out, cached, held = run(engine, y)
    assert out == hf_greedy(tiny_model_dir, y, GREEDY.max_tokens)
    assert cached == (8 if digest is parent_blind else 0) and collided not in held


def test_token_only_verification_would_reuse_the_wrong_kv(tiny_model_dir, monkeypatch):
    """The hazard the parent check removes: with the same colliding digest and the old check (a block's own
    token ids only), Y takes X's C block and its output departs from HF's."""
    monkeypatch.setattr("serving.core.block_manager.block_digest", parent_blind)

    def token_only_hits(self, seq):
        count = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i, digest in enumerate(self._digests(seq, count)):
            block_id = self.hash_to_block_id.get(digest)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    monkeypatch.setattr(BlockManager, "_prefix_hits", token_only_hits)
    with one_torch_thread():
        engine = tiny_engine(tiny_model_dir, block_size=BLOCK)
    a, b, c, d = (tokens(8, seed=s) for s in (10, 11, 12, 13))
    tail = [7, 8, 9]
    run(engine, a + c + tail)
    run(engine, b + d + tail)
    out, cached, _ = run(engine, b + c + tail)
    assert cached == 16  # B's two blocks from Z, then C's two from X: computed after A
    assert out != hf_greedy(tiny_model_dir, b + c + tail, GREEDY.max_tokens)


# ---- the keys file -----------------------------------------------------------------------------
def test_metrics_key_in_the_keys_file_and_from_the_command_line():
    table = parse_tenants({"keys": KEYS, "metrics_key": "sk-metrics-0001"})
    assert table.metrics_key == "sk-metrics-0001"
    assert table.with_metrics_key("sk-other-metrics").metrics_key == "sk-other-metrics"
    assert table.with_metrics_key(None) is table
    with pytest.raises(ValueError, match="at least 8 characters"):
        parse_tenants({"keys": KEYS, "metrics_key": "short"})
    with pytest.raises(ValueError, match="must differ from every tenant's API key"):
        parse_tenants({"keys": KEYS, "metrics_key": "sk-team-a-0001"})
    with pytest.raises(ValueError, match="must differ"):
        table.with_metrics_key("sk-team-b-0001")


def test_serve_refuses_a_short_metrics_key_before_loading_the_model(capsys):
    from quantgate.cli import main

    assert main(["serve", "--model", "no-such-model", "--metrics-key", "short"]) == 2
    assert "--metrics-key must be at least 8 characters" in capsys.readouterr().err


# ---- over HTTP ---------------------------------------------------------------------------------
def test_http_isolation_cache_salt_and_metrics_key(tiny_model_dir):
    tenants = parse_tenants({"keys": KEYS, "metrics_key": "sk-metrics-0001"})
    auth = {name: {"Authorization": f"Bearer {key}"} for key, name in KEYS.items()}
    with one_torch_thread(), running_server(tiny_model_dir, {"block_size": BLOCK}, tenants=tenants) as srv:
        url = f"{srv.url}/v1/completions"
        prompt = tokens(25, seed=20)

        def hits_of(tenant: str, **extra) -> int:
            before = srv.engine.stats().prefix_cache_hit_tokens
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **extra}
            r = httpx.post(url, json=body, headers=auth[tenant], timeout=60)
            assert r.status_code == 200, r.text
            return srv.engine.stats().prefix_cache_hit_tokens - before

        assert hits_of("a") == 0
        assert hits_of("b") == 0  # A's prefix, B's request: nothing reused
        assert hits_of("a") == 24
        assert hits_of("a", cache_salt="s1") == 0
        assert hits_of("a", cache_salt="s1") == 24
        for bad in ("", 7):
            r = httpx.post(url, json={"prompt": "hi", "cache_salt": bad}, headers=auth["a"], timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"

        assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 401
        r = httpx.get(f"{srv.url}/metrics", headers=auth["a"], timeout=30)  # a tenant's key is not enough
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_metrics_key"
        r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sk-metrics-0001"}, timeout=30)
        assert r.status_code == 200 and "quantgate:prefix_cache_hits_total" in r.text


def test_metrics_without_a_metrics_key(tiny_model_dir):
    with one_torch_thread(), running_server(tiny_model_dir, tenants=parse_tenants({"keys": KEYS})) as srv:
        r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sk-team-a-0001"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "no_metrics_key"
    with one_torch_thread(), running_server(tiny_model_dir) as srv:  # no tenants: open, as before
        assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 200
