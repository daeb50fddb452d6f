"""The CLI: thin Typer modules (installed as ``moetool.commands``): the experiments' commands generated from their
specs (``generated.py``, plus a module per command for what is its own), and the commands that are not experiments."""
