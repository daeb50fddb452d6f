"""``python oom_ranks.py ARGS...``: the ``moetool`` CLI with ARGS in a process whose forwards run out of memory above
a number of rows, the substitution tests/test_suggestions_runtime.py makes in one process, here per rank of a launch.

``MOETOOL_TEST_OOM_ROWS``: the rows that fit, one number per global rank (``4,2``): a forward of more rows runs (its
collectives too: every rank of a model group takes part in them) and then raises ``torch.OutOfMemoryError``, as the
next-token NLL of a batch too large for the rank's memory does after the model's last collective.
``MOETOOL_TEST_FREE_BYTES``: the free memory ``--batch-size auto`` reads (``moetool.sizing.available_memory``).
"""

from __future__ import annotations

import os
import sys

import torch

from moetool import sizing
from moetool.engine import runner


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    fit = int(os.environ["MOETOOL_TEST_OOM_ROWS"].split(",")[rank])
    step = runner._Step.__call__

    def limited(self, b, first):
        out = step(self, b, first)
        if b.input_ids.shape[0] > fit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out

    runner._Step.__call__ = limited
    free = os.environ.get("MOETOOL_TEST_FREE_BYTES")
    if free:
        sizing.available_memory = lambda dev: int(free)
    from moetool.commands.app import main as cli

    sys.argv = ["moetool", *sys.argv[1:]]
    cli()


if __name__ == "__main__":
    main()
