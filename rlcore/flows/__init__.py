"""The Prefect flows of the model lifecycle (data_prep -> train -> evaluate -> promote and the
rl_pipeline that composes them), inside the installed package so that a wheel can run and serve
the pipeline. The repository's `flows/` and `prefect.yaml` (the Prefect project) re-export these.

Importing this package imports nothing heavy; each flow module imports Prefect."""
