"""The fleet's pure parts, no Ray: KV-aware ranking, the traffic split, the schedule and the predictive policy."""

from __future__ import annotations

import random

import pytest

from fleet.autoscale_policy import PredictivePolicy
from fleet.config import FleetConfig
from fleet.kv_router import ReplicaKV, rank_replicas, with_inflight
from fleet.schedule import Schedule
from fleet.traffic import TrafficState


def kv(num_blocks: int, reserved: int, waiting: int = 0) -> ReplicaKV:
    return ReplicaKV(num_blocks=num_blocks, reserved_blocks=reserved, num_waiting=waiting, block_size=16)


def test_kv_router_prefers_the_most_free_kv_after_admission():
    loads = [kv(100, 90), kv(100, 20), kv(100, 50)]
    assert rank_replicas(loads, need_tokens=160) == [1, 2, 0]  # 10 blocks: all admit, most left first


def test_kv_router_never_offers_a_replica_that_cannot_admit_while_another_can():
    # replica 0 has the shortest queue and replica 2 the largest cache, but only replica 1 has room
    loads = [kv(64, 60, waiting=0), kv(64, 40, waiting=5), kv(256, 250, waiting=1)]
    assert rank_replicas(loads, need_tokens=20 * 16) == [1]
    rng = random.Random(0)
    for _ in range(500):  # crafted at random: whenever one admits, the choice admits
        loads = [kv(n := rng.randint(1, 128), rng.randint(0, n), rng.randint(0, 9)) for _ in range(rng.randint(1, 6))]
        need = rng.randint(1, 128 * 16)
        order = rank_replicas(loads, need)
        admitting = [i for i, r in enumerate(loads) if r.admits(need)]
        if admitting:
            assert order and all(loads[i].admits(need) for i in order)
            best = max(loads[i].free_blocks for i in admitting)
            assert loads[order[0]].free_blocks == best
        else:
            assert sorted(order) == list(range(len(loads)))
            assert [loads[i].num_waiting for i in order] == sorted(r.num_waiting for r in loads)


def test_kv_router_counts_requests_it_sent_since_the_last_report():
    report = kv(64, 0)
    inflight = {"a": (10.0, 40), "b": (4.0, 40)}  # b was sent before the report: the report counts it
    seen = with_inflight(report, reported_at=5.0, inflight=inflight)
    assert seen.free_blocks == 24
    assert rank_replicas([seen, kv(64, 30)], need_tokens=30 * 16) == [1]
    assert rank_replicas([None, kv(64, 64)], need_tokens=16) == [0]  # no report yet beats a full one


def test_split_is_sticky_and_within_tolerance():
    state = TrafficState({"champion": 0.8, "challenger": 0.2}, "champion")
    picks = [state.pick(f"user-{i}") for i in range(4000)]
    share = picks.count("challenger") / len(picks)
    assert abs(share - 0.2) < 0.03
    assert all(state.pick(f"user-{i}") == picks[i] for i in range(200))  # the same user, the same version
    state.set_weights({"champion": 0.5, "challenger": 0.5}, reason="widen the canary")
    moved = sum(1 for i in range(4000) if picks[i] == "challenger" and state.pick(f"user-{i}") != "challenger")
    assert moved == 0  # widening the challenger's slice keeps its users on it


def test_promote_and_rollback_are_recorded_with_time_and_reason():
    state = TrafficState({"champion": 0.9, "challenger": 0.1}, "champion")
    state.promote("challenger", reason="canary gates passed")
    assert state.weights == {"champion": 0.0, "challenger": 1.0} and state.champion == "challenger"
    assert state.pick("anyone") == "challenger"
    state.rollback(reason="p99 TTFT regressed")  # the challenger out, not back to its 0.1 (docs/serving.md)
    assert state.weights == {"champion": 0.9, "challenger": 0.0} and state.champion == "champion"
    actions = [(c.action, c.reason) for c in state.history]
    assert actions == [("start", "fleet up"), ("promote", "canary gates passed"), ("rollback", "p99 TTFT regressed")]
    assert state.history[1].time <= state.history[2].time
    with pytest.raises(ValueError, match="reason"):
        state.promote("champion", reason=" ")
    with pytest.raises(ValueError, match="unknown version"):
        state.promote("nope", reason="x")


def test_schedule_scales_out_ahead_and_the_policy_never_goes_below_it():
    sched = Schedule(((0.0, 1), (600.0, 4), (900.0, 1)), period_s=3600.0, origin=1000.0)
    assert sched.replicas_at(1000.0 + 599) == 1 and sched.replicas_at(1000.0 + 600) == 4
    assert sched.planned(1000.0 + 540, lead_s=60) == 4  # a minute ahead of the burst
    assert sched.planned(1000.0 + 899, lead_s=60) == 4  # never scales in ahead
    policy = PredictivePolicy([[0, 1], [600, 4], [900, 1]], period_s=3600, origin=1000, lead_s=60,
                              target_ongoing_requests=2)
    assert policy.decide(1000 + 100, ongoing_requests=0, current=1)[0] == 1
    assert policy.decide(1000 + 100, ongoing_requests=7, current=1)[0] == 4  # reactive: ceil(7 / 2)
    assert policy.decide(1000 + 550, ongoing_requests=0, current=1)[0] == 4  # predictive


def test_fleet_config_checks():
    cfg = FleetConfig.model_validate({"name": "m", "versions": [{"name": "a", "model": "x"},
                                                                {"name": "b", "model": "y"}]})
    assert cfg.champion == "a" and [v.weight for v in cfg.versions] == [1.0, 0.0]
    with pytest.raises(ValueError, match="unique"):
        FleetConfig.model_validate({"name": "m", "versions": [{"name": "a", "model": "x"}] * 2})
    with pytest.raises(ValueError, match="min_replicas"):
        FleetConfig.model_validate({"name": "m", "versions": [
            {"name": "a", "model": "x", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]})


def test_simulated_burst_predictive_matches_the_warm_pool_at_a_fraction_of_its_cost():
    import math

    from benchmarks.fleet_sim import Policy, ReplicaModel, Trace, simulate, summarize_result

    model = ReplicaModel(cold_start_s=20.0, slots=8, service_s=4.0, prefill_s=0.1)
    trace = Trace(quiet_rate=0.5 * model.rate, quiet_s=60, burst_s=30, tail_s=60)
    burst = math.ceil(1.2 * trace.quiet_rate * trace.burst_factor / model.rate)
    sched = Schedule(((0.0, 1), (trace.burst_start, burst), (trace.burst_start + trace.burst_s, 1)), period_s=1e6)
    rows = {p.name: summarize_result(simulate(trace, model, p), slo_ttft_s=2.0) for p in (
        Policy("zero", 0, 16, 8), Policy("pool", burst, 16, 8),
        Policy("predictive", 1, 16, 8, schedule=sched, lead_s=25.0))}
    assert rows["zero"]["requests"] == rows["pool"]["requests"] > 100
    assert rows["zero"]["over_slo"] > 50  # the burst arrives before reactive replicas are warm
    assert rows["pool"]["over_slo"] <= 5 and rows["predictive"]["over_slo"] <= 5
    assert rows["predictive"]["replica_seconds"] < 0.6 * rows["pool"]["replica_seconds"]


def test_release_canary_backend_ray_puts_the_canary_on_the_fleet():
    from fleet.canary import FleetCanary
    from flows import canary_stage as canary

    assert canary.canary_class() is canary.Canary
    ray_canary = canary.canary_class("ray")
    assert issubclass(ray_canary, FleetCanary) and ray_canary.replay is canary.Canary.replay
    with pytest.raises(ValueError, match="local or ray"):
        canary.canary_class("k8s")
