"""serving/model/quant/: the quantized layers the engine serves, one module per weight format (int8, int4), the
kernel each layer takes (kernel_path), their files (checkpoint) and the variant directory's contract (integrity, loader)."""
