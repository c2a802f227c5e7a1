"""The OpenAI-compatible HTTP server: app, routes, request models, streams, errors, metrics, API keys, the engine loop it drives."""
