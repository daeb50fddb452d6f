"""The ``norm-select`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
