"""moetool: Mixture-of-Experts routing research from the command line.

Importing this package is cheap: torch and transformers load only inside the
functions that need them (``moetool --help`` never imports torch).
"""

__version__ = "0.1.0"
