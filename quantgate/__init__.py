"""quantgate: quantize, serve, evaluate and gate LLM releases."""

__version__ = "0.1.0"
