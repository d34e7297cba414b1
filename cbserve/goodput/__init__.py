"""The goodput benchmark's parts, shared by the measurement and the prediction.

Workload mixes and traces (`workloads`, `trace`), the open-loop client (`loadgen`), Prometheus
scraping (`prom`), per-run statistics (`stats`), the text table (`report`) and plots (`plots`).
`bench/goodput.py` measures a real cluster with them; `cbserve plan` (`cbserve.planner`) predicts
the same rows for the same requests, and `cbserve profile` calibrates against a short real run.
"""
