"""Tensor and pipeline parallelism for the paged engine over torch.distributed (gloo on CPU, NCCL on CUDA).

    engine = LLMEngine.from_pretrained("smollm2-135m", tensor_parallel_size=2)   # or pipeline_parallel_size=2
    ...
    engine.parallel.shutdown()                                                     # stops every rank

sharding.py cuts the HF model (shards, stages), plan.py is what rank 0 broadcasts each step, ranks.py
what each rank runs, launcher.py starts, watches and stops the ranks.
"""

from serving.model.parallel.launcher import ParallelConfig, ParallelGroup, from_pretrained_parallel, launch
from serving.model.parallel.ranks import RankFailedError

__all__ = ["ParallelConfig", "ParallelGroup", "RankFailedError", "from_pretrained_parallel", "launch"]
