"""The ``placement`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
