"""Imported at startup by every Python process of a vLLM server that `bench peers --isa avx2` starts
(benchmarks/peer_isa.py puts this folder on its PYTHONPATH): vLLM's CPU build loads its AVX-512 kernel
library when `torch.cpu` says the CPU has AVX-512, so here it says no, for AVX-512 and AMX alike."""

try:
    import torch.cpu
except ImportError:  # not a torch environment: nothing to force
    torch = None

if torch is not None:
    for _name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
