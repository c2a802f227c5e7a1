"""quantgate's own C++ CPU kernels: how they are built (`build`), which instruction set runs (`isa`), and
the weight-only linear over fp32 activations for every x86 CPU (`wo_linear`)."""

from serving.kernels.cpu.build import CFLAGS, PRECISE_CFLAGS, build_dir, cpu_signature, load, sources_hash

__all__ = ["CFLAGS", "PRECISE_CFLAGS", "build_dir", "cpu_signature", "load", "sources_hash"]
