"""The ``locality`` experiment: ``spec.py`` (torch-free), ``compute.py``."""
