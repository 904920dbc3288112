"""What a run reports: per-step metrics and plots (``metrics.py``), external trackers (TensorBoard,
W&B, MLflow: ``trackers.py``), per-rank step times and stragglers (``rank_stats.py``), the event
log (``events.py``), the torch profiler window (``profiler.py``), the run report (``report.py``)
and model FLOPs utilisation (``mfu.py``). docs/observability.md is the user's guide.
"""
