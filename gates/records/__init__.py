"""gates/records/: what MLflow holds: runs and metrics (tracking, metric_names), the registry's aliases, lineage, comparisons and plots, orphaned runs."""
