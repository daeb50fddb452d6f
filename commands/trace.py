"""``moetool trace`` (generated from ``moetool/experiments/trace/spec.py``): ``--format``, and the trace streamed
into the run folder under a temporary name, renamed once complete."""

from __future__ import annotations

from typing import Any

FORMATS = ("csv.gz", "parquet")


def check(p: Any, opts: Any) -> dict[str, Any]:
    from moetool.errors import MoetoolError

    if p.format not in FORMATS:
        raise MoetoolError(f"--format must be csv.gz or parquet, not '{p.format}'")
    name = f"trace.{p.format}"

    def call(compute: Any, args: tuple[Any, ...], kwargs: dict[str, Any], folder: Any) -> Any:
        if getattr(folder, "discard", False):  # a rank other than 0 under torchrun: its rows go to rank 0
            return compute(*args, quiet=kwargs["quiet"])
        res = None
        with folder.atomic(name, rows=lambda: res.meta.get("trace_rows")) as tmp:  # its record in the manifest
            res = compute(*args, path=tmp, **kwargs)
        res.meta["files"] = {"trace": name}
        return res

    return {"manifest": {"format": p.format}, "call": call}


def written(res: Any, p: Any) -> Any:
    return res.path / f"trace.{p.format}"  # the command names the trace file, not the folder
