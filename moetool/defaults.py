"""Defaults shared by the library and the command line, importable without numpy or torch (``moetool --help``
reads them from the experiments' specs)."""

from __future__ import annotations

#: replicates of the document-level bootstrap behind every 95% interval (``--bootstrap``)
DEFAULT_BOOTSTRAP = 1000
