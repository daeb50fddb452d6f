"""Names of the embedded models the demo, the examples and the tests run on (beside :mod:`moetool.loading`; light)."""

#: the base models every demo step runs on (built by examples/train_tiny.py, shipped in moetool/embedded)
DEMO_MODELS = ("tiny", "tiny-fine")
