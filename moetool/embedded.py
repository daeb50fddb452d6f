"""Names of the embedded models the demo and the examples use (beside :mod:`moetool.loading`, without importing it)."""

#: the base models every demo step runs on (built by examples/train_tiny.py, shipped in moetool/models)
DEMO_MODELS = ("tiny", "tiny-fine")
