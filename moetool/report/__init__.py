"""Reporting: the run directory (CSVs, figures, manifest), figures in the house style, console tables, and the
report page that gathers runs (``write_report``)."""

from .page import write_report
from .rundir import RunDir

__all__ = ["RunDir", "write_report"]
