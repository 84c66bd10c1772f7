"""Cross-cutting runtime for the entry points and training pipelines: distributed setup, precision,
the optimizer-update loop and evaluation, checkpoints, metric logging, preemption, optimizer/schedule.
"""
