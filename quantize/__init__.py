"""quantize/: INT8 and INT4 variants of a model, as verified directories the engine can serve.

    from quantize import quantize
    from quantize import load_model
    variant_dir = quantize("smollm2-135m", "nf4")         # cached under QUANTGATE_HOME/variants
    model = load_model(variant_dir, "cpu", None)           # any model dir: plain HF or variant

Importing this package is cheap: torch and transformers load inside the functions that need them.
"""

from quantize.methods import METHODS, Method, get_method
from quantize.variant import quantize, variants_root
from serving.model.quant.integrity import CorruptVariantError, is_variant, read_manifest, verify_variant
from serving.model.quant.loader import load_model, load_variant

__all__ = [
    "METHODS",
    "CorruptVariantError",
    "Method",
    "get_method",
    "is_variant",
    "load_model",
    "load_variant",
    "quantize",
    "read_manifest",
    "variants_root",
    "verify_variant",
]
