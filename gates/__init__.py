"""Release gates recorded in MLflow and promotion by registered-model alias.

`tracking` records releases (parent run) and variants (nested runs, registered versions); `metrics`
is the metric naming convention producers and gates share; `policy` parses `policy.yaml`; `evaluate`
judges recorded metrics and records verdicts; `registry` approves, promotes, rolls back; `compare`
and `plots` put a release's variants side by side. See docs/gates.md.
"""
