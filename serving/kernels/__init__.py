"""serving/kernels/: the engine's compiled kernels: cpu/ (C++ per x86 instruction set), cuda/ (Triton)."""
