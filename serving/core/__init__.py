"""The engine core: requests, their KV blocks, the schedulers and the engine that steps them (no model code, no HTTP)."""
