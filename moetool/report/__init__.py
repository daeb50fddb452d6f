"""Reporting: the run directory (CSVs, figures, manifest) and console tables."""

from .rundir import RunDir

__all__ = ["RunDir"]
