"""The ``super-experts`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
