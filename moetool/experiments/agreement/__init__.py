"""The ``agreement`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
