"""The ``fluctuation`` experiment: ``spec.py`` (torch-free), ``compute.py``, ``figures.py``."""
