"""The ``mass-recall`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
