"""One error type for everything a user can get wrong: the CLI prints it as one line.

``exit_code`` is what the command exits with: 2 for a usage error (the command line asks for something this model or
these options cannot do), 1 for a runtime error (:class:`MoetoolRuntimeError`: no network, a corrupt file, no CUDA
device, not enough memory). :func:`spans` writes index runs for such messages.
"""

from __future__ import annotations

from typing import Any


class MoetoolError(Exception):
    """A user-facing error (bad input, unknown model, bad flag value...). Printed as one line; exit code 2."""

    exit_code = 2


class MoetoolRuntimeError(MoetoolError):
    """A user-facing error of the machine or the files rather than the command line (no network, corrupt
    weights, no CUDA, not enough memory). Printed as one line; exit code 1."""

    exit_code = 1


#: ``errno`` values of a write that ran out of room (disk full, quota, file size limit): the machine's problem
DISK_FULL = frozenset(("ENOSPC", "EFBIG", "EDQUOT"))


def is_disk_full(e: BaseException) -> bool:
    """``e`` is an :class:`OSError` of a full disk, an exhausted quota or a file size limit."""
    import errno

    return isinstance(e, OSError) and errno.errorcode.get(e.errno or -1) in DISK_FULL


def write_error(e: OSError, path: object = None, *, what: str = "write") -> MoetoolRuntimeError:
    """One line (exit 1) for an :class:`OSError` while writing ``path`` (default: the file the error names; when
    it names none, a full disk is most likely the temporary folder, ``TMPDIR``, and the line says which that is)."""
    where = path if path is not None else e.filename
    if where is None:
        import tempfile

        where = f"a file (none named; temporary files go to {tempfile.gettempdir()}, set by TMPDIR)"
    hint = ": free space or write elsewhere (--out, TMPDIR)" if is_disk_full(e) else ""
    return MoetoolRuntimeError(f"cannot {what} {where}: {e.strerror or e}{hint}")


#: the longest timeout :func:`env_seconds` accepts (about 31 years; torch's and threading's limits are larger)
MAX_SECONDS = 1e9


def env_seconds(name: str, default: float | None = None) -> float | None:
    """The environment variable ``name`` as a positive, finite number of seconds (``default`` when unset or
    empty); anything else (``-1``, ``0``, ``inf``, ``nan``, ``soon``) is a one-line usage error."""
    import os

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 < value <= MAX_SECONDS):  # NaN fails too
        raise MoetoolError(f"{name} must be a number of seconds greater than 0 and at most {MAX_SECONDS:g}, "
                           f"not '{raw}'")
    return value


#: the files each figure of a run is saved as, by default (``MOETOOL_FIGURES`` chooses others)
FIGURE_FORMATS = ("png", "pdf")


def env_figures() -> tuple[str, ...]:
    """The formats ``MOETOOL_FIGURES`` asks each figure of a run to be saved in: unset or empty, both of
    :data:`FIGURE_FORMATS` (PNG for the report page, PDF for papers); ``png``, ``pdf`` or ``png,pdf``; ``none`` draws
    no figure at all (the tables only: a sweep of many runs, or tests that compare tables). Anything else is a
    one-line usage error."""
    import os

    raw = os.environ.get("MOETOOL_FIGURES", "").strip().lower()
    if not raw:
        return FIGURE_FORMATS
    if raw == "none":
        return ()
    asked = [f.strip() for f in raw.split(",")]
    if any(f not in FIGURE_FORMATS for f in asked) or len(set(asked)) != len(asked):
        raise MoetoolError(f"MOETOOL_FIGURES must be png, pdf, png,pdf or none, not "
                           f"'{os.environ['MOETOOL_FIGURES'].strip()}'")
    return tuple(f for f in FIGURE_FORMATS if f in asked)


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an error's text, or its type name when it has none (an empty ``EOFError`` of a
    0-byte file: ``str(e).splitlines()[0]`` raised IndexError in the middle of an error message)."""
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


def one_line(exc: BaseException, limit: int = 240) -> str:
    """The first non-empty line of an error, at most ``limit`` characters, after its type name unless it is one of
    moetool's own (whose text is written to be read alone); a first line that ends in a colon is a heading: the
    line after it follows it (transformers' "Validation error for field 'hidden_size':" says why on the next)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    if isinstance(exc, MoetoolError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def shown(value: Any, *, typed: bool = False, limit: int = 120) -> str:
    """How a one-line message names a value it refuses: its ``repr`` when that is one short line (``'tiny'``, ``3``,
    ``None``; after its type name with ``typed``: ``str 'text.txt'``), else its type, and shape where it has one
    (``a MixtralForCausalLM``, ``a Tensor of shape (4, 64)``, ``a DataFrame of shape (6, 2)``): a model, a tensor
    or a table passed by mistake is named, never dumped over several lines."""
    text = repr(value)
    if "\n" not in text and len(text) <= limit:
        return f"{type(value).__name__} {text}" if typed else text
    kind = type(value).__name__
    shape = getattr(value, "shape", None)
    try:
        of = f" of shape {tuple(int(s) for s in shape)}" if shape is not None else ""
    except (TypeError, ValueError):
        of = ""
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}{of}"


def spans(indices: Any) -> str:
    """``[0, 1, 2, 3, 5, 7, 8]`` -> ``"0-3, 5, 7-8"``: runs of consecutive (layer) indices, for a message or a
    table."""
    runs: list[list[int]] = []
    for i in sorted(int(x) for x in indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def layers_of_one(values: dict[int, Any], what: str, symbol: str) -> Any:
    """The one ``symbol`` (K, n, ...) the chosen MoE layers share (``values``: decoder index -> its value), or one
    line: ``what`` differs, and the ``--layers`` of each value that a rerun may choose (the most layers first)."""
    groups: dict[Any, list[int]] = {}
    for i in sorted(values):
        groups.setdefault(values[i], []).append(i)
    if len(groups) == 1:
        return next(iter(groups))
    ways = " or ".join(f"--layers {spans(ix).replace(' ', '')} ({symbol} = {v})"
                       for v, ix in sorted(groups.items(), key=lambda g: (-len(g[1]), g[1])))
    raise MoetoolError(f"{what}: choose layers of one {symbol}: {ways}")
