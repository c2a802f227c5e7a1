"""Model execution: the runner, the decoder forward, attention, the linear layers, devices, the CUDA kernels and tensor/pipeline parallelism."""
