"""The engine's and the scheduler's contracts (serving/core/engine_interface.py, serving/core/scheduler_interface.py):
every batching policy states it, the scheduler reports per-tenant load without callers walking its queues,
options reach the engine at construction, and the light modules stay light. No model is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serving import LLMEngine, SamplingParams
from serving.core.block_manager import BlockManager
from serving.core.fairness import TenantFairness
from serving.core.scheduler_interface import SchedulerInterface
from serving.core.schedulers import SCHEDULERS
from serving.core.sequence import Sequence


def _seq(rid: str, tenant: str, prompt_len: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return Sequence(rid, None, list(range(10, 10 + prompt_len)), params, tenant=tenant)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_policy_states_the_scheduler_contract(name):
    assert issubclass(SCHEDULERS[name], SchedulerInterface)
    sched = SCHEDULERS[name](BlockManager(64, 4), 4, 512, fairness=TenantFairness())
    assert sched.tenant_load().running == {} and not sched.has_unfinished()


def test_tenant_load_counts_running_waiting_and_held_blocks():
    sched = SCHEDULERS["continuous"](BlockManager(64, 4), 2, 512)
    for rid, tenant in (("a1", "a"), ("b1", "b"), ("a2", "a")):
        sched.add(_seq(rid, tenant))
    sched.schedule()  # two slots: a1 and b1 run, a2 waits
    load = sched.tenant_load()
    assert load.running == {"a": 1, "b": 1} and load.waiting == {"a": 1}
    assert load.kv_blocks == {"a": 2, "b": 2}  # 8 prompt tokens in blocks of 4


def test_batch_timeout_is_a_constructor_option_of_the_dynamic_scheduler_only():
    with pytest.raises(ValueError, match="dynamic"):
        LLMEngine(None, None, scheduler="static", batch_timeout_s=0.1)


def test_the_contracts_and_the_fairness_import_no_torch_and_no_file_parsing():
    code = ("import sys, serving.core.engine_interface, serving.core.scheduler, serving.core.fairness; "
            "bad = [m for m in ('torch', 'pydantic', 'serving.http.tenants', 'serving.core.engine') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
