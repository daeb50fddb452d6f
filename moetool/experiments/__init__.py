"""Experiments: one folder each (``spec.py``, ``compute.py``), functions from captured routing events (or a model's
weights, or its config) to tables (pandas DataFrames)."""
