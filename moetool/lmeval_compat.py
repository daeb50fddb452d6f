"""Every patch moetool applies to lm-evaluation-harness (and the Hub libraries it drives), in one place.

* :func:`hub_offline`: ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` for a block (env vars and the module constants
  ``datasets`` and ``huggingface_hub`` read at import), restored after; used when only shipped tasks are asked.
* :func:`no_env_report`: ``lm_eval.evaluator.add_env_info`` and ``get_git_commit_hash`` replaced by no-ops for a
  block (lm-eval's environment report runs ~12 subprocesses per call; the run's manifest records the versions).

The patches name private details of these libraries. :data:`TESTED_VERSION` is the lm-eval version they were
checked against; ``tests/test_eval.py`` fails with a clear message when the installed version differs, and
:func:`check` raises one clear error at run time if a patched attribute has gone.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator
from unittest import mock

from .errors import MoetoolError

#: the lm-eval version the patches below were written and tested against
TESTED_VERSION = "0.4.13"

#: attributes of ``lm_eval.evaluator`` replaced by :func:`no_env_report`
EVALUATOR_PATCHES = ("add_env_info", "get_git_commit_hash")


def installed_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("lm_eval")
    except md.PackageNotFoundError:
        return None


def check() -> None:
    """One clear error if an attribute moetool patches is missing from the installed lm-eval."""
    from lm_eval import evaluator

    missing = [a for a in EVALUATOR_PATCHES if not hasattr(evaluator, a)]
    if missing:
        raise MoetoolError(f"lm-eval {installed_version()} has no evaluator.{', '.join(missing)}: moetool's "
                           f"compatibility patches were written for lm-eval {TESTED_VERSION} "
                           f"(see moetool/lmeval_compat.py)")


@contextlib.contextmanager
def no_env_report() -> Iterator[None]:
    """lm-eval's environment report (torch collect_env, git subprocesses) off for the block."""
    from lm_eval import evaluator

    check()
    with contextlib.ExitStack() as stack:
        for attr in EVALUATOR_PATCHES:
            stack.enter_context(mock.patch.object(evaluator, attr, lambda *a, **k: None))
        yield


@contextlib.contextmanager
def hub_offline(enabled: bool = True) -> Iterator[None]:
    """``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` for the block, restored after.

    ``datasets`` and ``huggingface_hub`` read these at import: they are imported first and their
    module constants patched too (lm-eval imports them anyway).
    """
    if not enabled:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    targets = [(datasets.config, "HF_DATASETS_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
               (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    old = [getattr(m, a) for m, a in targets]
    try:
        os.environ.update({k: "1" for k in env})
        for m, a in targets:
            setattr(m, a, True)
        yield
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for (m, a), v in zip(targets, old):
            setattr(m, a, v)
