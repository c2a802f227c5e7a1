"""Load generation against an OpenAI-compatible server: the streaming client (`client`), the load run and
its report (`run`), their statistics, the shipped prompts. The release's serving stage, its canary replay
and the benchmarks all drive servers through this one package."""
