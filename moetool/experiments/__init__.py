"""Experiments: functions from captured routing events to tables (pandas DataFrames)."""
