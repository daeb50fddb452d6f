"""The ``expert-similarity`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
