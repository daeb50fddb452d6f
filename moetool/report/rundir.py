"""One run-directory convention for every command that writes results.

``--out DIR`` (default ``runs/<command>-<timestamp>``) holds the CSVs, ``figures/`` (PNG
and PDF) and ``manifest.json``: command line, resolved options, versions, seed, model id
and config, device, wall time, the files written. A non-empty ``--out`` is refused
unless ``--force``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import MoetoolError


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("moetool", "torch", "transformers", "accelerate", "lm-eval"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


class RunDir:
    def __init__(self, path: Path, command: str):
        self.path = path
        self.command = command
        self.started = time.time()
        self.files: list[str] = []
        self.sections: dict[str, Any] = {}

    @classmethod
    def create(cls, command: str, out: str | Path | None = None, force: bool = False) -> "RunDir":
        path = Path(out) if out else Path("runs") / f"{command}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        if path.exists() and not path.is_dir():
            raise MoetoolError(f"--out {path} exists and is not a directory")
        if path.is_dir() and any(path.iterdir()) and not force:
            raise MoetoolError(f"--out {path} is not empty (use --force to write into it)")
        (path / "figures").mkdir(parents=True, exist_ok=True)
        return cls(path, command)

    @property
    def figures(self) -> Path:
        return self.path / "figures"

    def sub(self, name: str) -> "RunDir":
        """A child run directory (``demo`` puts each experiment in its own)."""
        child = RunDir(self.path / name, name)
        (child.path / "figures").mkdir(parents=True, exist_ok=True)
        return child

    def _record(self, p: Path) -> Path:
        rel = str(p.relative_to(self.path))
        if rel not in self.files:
            self.files.append(rel)
        return p

    def file(self, name: str) -> Path:
        """A path in the run directory for a file the caller writes itself (listed in the manifest)."""
        return self._record(self.path / name)

    def write_csv(self, name: str, df: Any) -> Path:
        """Write a pandas DataFrame as ``name`` (``.csv`` or ``.csv.gz``)."""
        if len(df) == 0:
            raise MoetoolError(f"nothing to write to {name}: no rows (empty data?)")
        p = self.path / name
        df.to_csv(p, index=False)
        return self._record(p)

    def write_json(self, name: str, obj: Any) -> Path:
        p = self.path / name
        p.write_text(json.dumps(_jsonable(obj), indent=2))
        return self._record(p)

    def save_figure(self, fig: Any, name: str) -> list[Path]:
        """``figures/<name>.png`` and ``.pdf``; closes the figure."""
        import matplotlib.pyplot as plt

        paths = []
        for ext in ("png", "pdf"):
            p = self.figures / f"{name}.{ext}"
            fig.savefig(p, dpi=150 if ext == "png" else None, bbox_inches="tight")
            paths.append(self._record(p))
        plt.close(fig)
        return paths

    def add(self, **sections: Any) -> None:
        """Extra manifest sections (data description, definitions, per-experiment notes)."""
        self.sections.update(sections)

    def finish(self, *, options: dict[str, Any], model: Any = None, seed: int | None = None) -> Path:
        """Write ``manifest.json`` (call last)."""
        manifest = {
            "command": self.command,
            "argv": sys.argv,
            "options": options,
            "seed": seed,
            "model": model.manifest() if hasattr(model, "manifest") else model,
            "versions": _versions(),
            "started": datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "wall_seconds": round(time.time() - self.started, 3),
            **self.sections,
            "files": self.files,
        }
        p = self.path / "manifest.json"
        p.write_text(json.dumps(_jsonable(manifest), indent=2))
        return p
