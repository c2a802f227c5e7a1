"""The batching policies by name (what `--scheduler` chooses): one line each."""

from __future__ import annotations

from serving.core.dynamic_batching import DynamicBatchScheduler
from serving.core.scheduler import Scheduler, StaticScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    "continuous": Scheduler,
    "static": StaticScheduler,
    "dynamic": DynamicBatchScheduler,
}
