"""quantgate's fleet: the serving engine replicated on Ray Serve.

One Ray Serve application per model: a deployment per version (champion, challenger, ...) whose
replicas each run one `serving.LLMEngine`, an OpenAI-compatible ingress that splits traffic by
weight (sticky per `user`), a KV-aware request router and a predictive autoscaling policy.
Sits above `serving/` and imports it; knows nothing of MLflow or Prefect. Ray is imported lazily.
"""
