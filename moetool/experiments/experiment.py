"""What an experiment is: its :class:`Experiment` spec (with its :class:`Demo` and its generated command's
:class:`Flag` s), written in ``moetool/experiments/<name>/spec.py`` as ``SPEC = experiment(...)`` and found there by
:mod:`moetool.experiments.registry`. Torch-free: everything an experiment's code is named by is a ``"module:attr"``
string (``tests/test_layers.py`` resolves every one)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
import sys
from dataclasses import MISSING, dataclass, field
from typing import Any

from ..demo_models import DEMO_MODELS as BASE  # the embedded base models every demo step runs on
from ..errors import MoetoolError

#: the seeds every command takes (``--seed``): numpy's legacy seeding (lm-eval's ``numpy_random_seed``) takes 0 to
#: 2**32 - 1, ``np.random.default_rng`` any integer >= 0, ``torch.Generator.manual_seed`` up to 2**64 - 1 (seeds
#: derived from it, ``seed * 1_000_003 + layer``, stay below that): their common range
SEED_MAX = 2**32 - 1

PAIRS = (("tiny-early", "tiny"), ("tiny-fine-early", "tiny-fine"))


@dataclass(frozen=True)
class Demo:
    """How ``moetool demo`` runs an experiment: on ``models`` (``PAIRS`` for checkpoint pairs), ``max_tokens`` of
    the shipped held-out text in rows of ``seq_len`` (``None``: weights only), with ``options`` overriding the
    options dataclass's defaults (``options_from``: ``"module:attr"`` returning more overrides when the step runs,
    e.g. the shipped lm-eval tasks), and ``tokens`` passed to :func:`moetool.data.load_tokens`."""

    models: tuple[Any, ...] = BASE
    seq_len: int | None = 128
    max_tokens: int = 2048
    options: dict[str, Any] = field(default_factory=dict)
    options_from: str | None = None
    tokens: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Flag:
    """One option of an experiment's command (generated from the spec: :mod:`moetool.commands.generated`):
    ``--<flag>`` sets the options dataclass's field ``field`` (default: the flag's name with ``_`` for ``-``).
    ``kind`` is ``int``, ``float``, ``str``, ``path`` or ``bool`` (``--x/--no-x``), or ``ints``, ``floats``,
    ``strs``: a comma-separated list, a tuple in the options (``none``: the empty tuple). ``default`` is shown by
    ``--help`` (a list as its text, ``"0.5,1"``); ``None`` leaves the options dataclass's own. ``short`` is a
    one-letter alias (``-G``), ``min`` / ``max`` bound a number, ``required`` makes the flag mandatory; ``parse``
    (``"module:attr"``) turns the flag's text into the field's value instead of the kind's cast (e.g. a noise
    spec); ``to_options=False``: the flag is the command's own (read by its hooks), not an options field.
    Every number a flag gives (its value, a list's items, a float ``parse`` returns) must be finite: ``inf=True``
    lets it be ``inf`` (``--cf``: no capacity limit); NaN never (:meth:`check`)."""

    flag: str
    kind: str = "str"
    default: Any = None
    help: str = ""
    field: str | None = None
    short: str | None = None
    min: float | None = None
    max: float | None = None
    required: bool = False
    parse: str | None = None
    to_options: bool = True
    metavar: str | None = None
    inf: bool = False

    KINDS = ("int", "float", "str", "path", "bool", "ints", "floats", "strs")

    def __post_init__(self) -> None:
        if not self.flag.startswith("--") or self.kind not in self.KINDS:
            raise ValueError(f"bad Flag({self.flag!r}, {self.kind!r}): '--name' and one of {self.KINDS}")

    @property
    def name(self) -> str:
        """The option's field (and the generated command's parameter)."""
        return self.field or self.flag[2:].replace("-", "_")

    @property
    def many(self) -> bool:
        """A comma-separated list (a tuple in the options)."""
        return self.kind in ("ints", "floats", "strs")

    def check(self, value: Any) -> None:
        """One line (:class:`MoetoolError`) where a number of ``value`` (the field's value: a number, or a tuple of
        them) is NaN, infinite without :attr:`inf`, or outside :attr:`min` / :attr:`max`; the command line checks
        it as the flag is read, :func:`check_options` where the library's options are resolved. A list flag's
        value given twice is one line too, on both (:func:`moetool.registry.refuse_repeats`: the library ran it
        twice, mass_recall's ``codebook_sizes=(8, 8)`` counting every token twice in one row)."""
        if isinstance(value, (tuple, list)):  # a list flag (also --nodes, --norm: a str parsed to a list)
            from ..registry import refuse_repeats

            refuse_repeats(value, self.flag)
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                continue
            what = f"{self.flag} values" if self.many else self.flag
            if not isinstance(x, numbers.Integral) and (math.isnan(x) or (math.isinf(x) and not self.inf)):
                allowed = ("numbers or inf" if self.inf else "finite numbers") if self.many else \
                    ("a number or inf" if self.inf else "a finite number")
                raise MoetoolError(f"{what} must be {allowed}, not {x}")
            if (self.min is not None and x < self.min) or (self.max is not None and x > self.max):
                bounds = (f">= {self.min:g}" if self.max is None else f"<= {self.max:g}" if self.min is None
                          else f"from {self.min:g} to {self.max:g}")
                raise MoetoolError(f"{what} must be {bounds}, not {x}")


@dataclass(frozen=True)
class Experiment:
    """One experiment. ``module`` holds ``function`` (``(lm, tokens, options=None, *, quiet, **overrides) ->
    Result``; ``inputs`` says what it takes instead of ``(lm, tokens)``: ``"weights"`` and ``"model"`` =
    ``(lm, options)``, ``"checkpoints"`` = ``(names or models, tokens, options)``, ``"config"`` = a model's name and
    the command's flags, nothing loaded), ``options`` (its dataclass) and ``lines`` (``(name, Result) -> list[str]``:
    what the demo prints, and the manifest's ``headline``). ``api`` is its name in ``import moetool``; ``groups`` the
    standard flag groups its command takes beside those of its ``inputs`` (:mod:`moetool.commands.flags`:
    ``routing``, ``lmeval``, ``bootstrap``, ``resume``, ``trace``, ``traces``, or one flag of them by name) and
    ``defaults`` its own defaults of standard flags (``{"max_tokens": 32768}``); ``loads_model=False``: the compute
    function takes the model's name and loads it itself (once per precision); ``figures`` the ``"module:attr"`` drawing its figures, ``captions``
    theirs (figure name -> (what it shows, the tables it is drawn from, the manifest ``definitions`` it plots): the
    report page's); ``checkpoint_types`` the ``"module.Class"`` names a ``--resume`` unit of it may hold;
    ``special_tokens`` the ``add_special_tokens`` its command and ``moetool.run`` by name tokenize with (``None``: the
    tokenizer's own default, recorded in the manifest as ``special_tokens``); ``dtype_flag`` the flag choosing the
    dtype its models compute in, as an fp16 overflow's or an out-of-memory's suggestion names it (``--dtype``;
    agreement's ``--precisions``: the run's :attr:`moetool.context.RunState.dtype_flag`)."""

    name: str
    module: str
    function: str
    options: str | None = None
    api: str = ""
    inputs: str = "tokens"
    groups: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    loads_model: bool = True
    figures: str | None = None
    lines: str | None = "summary_lines"
    demo: Demo | None = None
    flags: tuple[Flag, ...] = ()
    bootstrap: bool = False
    title: str = ""
    summary_csv: str | None = None
    sample: tuple[str, ...] = ()
    order: int = 1000  # the demo's order (and the registry's): lowest first
    captions: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    checkpoint_types: tuple[str, ...] = ()
    special_tokens: bool | None = False  # how its command tokenizes: None = the tokenizer's own default (a BOS)
    dtype_flag: str = "--dtype"  # its flag choosing the dtype the models compute in (the run's, for suggestions)

    @property
    def result(self) -> str:
        """The :class:`Result` name its function returns (``norm_select`` for ``norm-select``)."""
        return self.function

    def load(self, attr: str | None = None) -> Any:
        """The compute function (or another attribute of the experiment's module)."""
        return getattr(importlib.import_module(self.module), attr or self.function)

    @property
    def spec_module(self) -> str:
        """``moetool.experiments.<name>.spec``: where the spec, its help text and its options dataclass live."""
        return f"moetool.experiments.{self.name.replace('-', '_')}.spec"

    def options_class(self) -> Any:
        """The options dataclass, ``spec.py``'s (torch-free: ``moetool --help`` reads its fields' flags)."""
        if not self.options:
            return None
        import importlib.util

        found = importlib.util.find_spec(self.spec_module) if self.module.startswith("moetool.") else None
        if found is None:  # a spec made by hand outside moetool (tests): its module's
            return self.load(self.options)
        own = importlib.import_module(self.spec_module)
        if not hasattr(own, self.options):  # the compute module is never imported for it (torch)
            raise RuntimeError(f"registry: {self.spec_module} has no {self.options} (an experiment's options "
                               "dataclass is declared in its spec.py, each field with its flag)")
        return getattr(own, self.options)

    def command_flags(self) -> tuple[Flag, ...]:
        """The flags of the experiment's command: those of its options fields (declared with :func:`option`, in
        field order) and then its command's own (``flags``)."""
        cls = self.options_class()
        fields = dataclasses.fields(cls) if cls is not None else ()
        return (*(dataclasses.replace(f.metadata["flag"], field=f.name) for f in fields if "flag" in f.metadata),
                *self.flags)


@dataclass(frozen=True)
class RoutingOptions:
    """How routing is replaced: a policy spec (``router`` = the model's own routing) and its options."""

    routing: str = "router"  # router | norm:<node>[:<norm>] | random | similarity[:tau] | attention
    # weights of the experts a norm policy chose: softmax | router | uniform (None: not given, softmax there)
    weights: str | None = None
    sim: str = "dot"  # similarity policy: dot | cosine
    causal: bool = True  # similarity policy: only tokens j <= i
    layers: tuple[int, ...] | None = None  # MoE layers whose routing is replaced (None: every MoE layer)
    seed: int = 0

    def policy(self) -> Any:
        """The policy, built once per run (the command's check and the experiment share it). ``weights`` given
        to a policy that takes none (every policy but ``norm``) is refused in one line, never ignored."""
        from ..policies import build_once, refuse_unread_similarity_options

        policy = build_once(self.routing, self.weights or "softmax", self.seed, sim=self.sim, causal=self.causal)
        if self.weights is not None and policy.weights is None:
            raise MoetoolError(f"--weights applies to norm:<node> policies only (the weights of the experts they "
                               f"choose); --routing {self.routing} takes none")
        refuse_unread_similarity_options([policy], self.routing, self.sim, self.causal)
        return policy


def check_seed(seed: Any, flag: str = "--seed") -> None:
    """``--seed`` (``seed=``; ``flag``: another seed's) is an integer from 0 to :data:`SEED_MAX`: one line
    otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= SEED_MAX:
        raise MoetoolError(f"{flag} must be an integer from 0 to {SEED_MAX} (2**32 - 1), not {seed!r}")


#: the lm-eval flag group's counts and their least values (the command line's ``min=``): ``limit=0`` went to lm-eval as
#: "no items" (a ValueError traceback: "task.build_requests() did not find any docs!"), ``limit=-1`` to islice (a
#: traceback), ``num_fewshot=-1`` ran silently as zero-shot under the name of -1 examples
LMEVAL_MINIMA = {"limit": 1, "num_fewshot": 0}


def check_lmeval_count(name: str, value: Any) -> None:
    """``limit`` / ``num_fewshot`` (lm-eval's flag group): ``None`` (lm-eval's own) or an integer at least its
    :data:`LMEVAL_MINIMA`; one line naming the flag otherwise."""
    least = LMEVAL_MINIMA[name]
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise MoetoolError(f"--{name.replace('_', '-')} must be an integer or None, not {value!r}")
    if value is not None and value < least:
        raise MoetoolError(f"--{name.replace('_', '-')} must be at least {least}, not {value}")


def check_options(options: Any) -> None:
    """The checks every options dataclass shares, where the library resolves its options (and where a command
    builds them): each flagged field's numbers (:meth:`Flag.check`), the seeds (:func:`check_seed`) and the rows per
    forward (:func:`moetool.sizing.check_sizes`, as ``--batch-size``)."""
    from ..sizing import check_sizes

    for f in dataclasses.fields(options):
        if "flag" in f.metadata:
            f.metadata["flag"].check(getattr(options, f.name))
        elif f.name in ("seed", "fewshot_seed"):
            check_seed(getattr(options, f.name), "--" + f.name.replace("_", "-"))
        elif f.name == "batch_size":
            check_sizes(batch_size=getattr(options, f.name))
        elif f.name in LMEVAL_MINIMA:
            check_lmeval_count(f.name, getattr(options, f.name))


def _fits(value: Any, hint: Any, path: bool) -> bool:
    """``value`` is of the type ``hint`` (an options field's annotation: ``int``, ``float``, ``str``, ``bool``,
    ``None``, unions of them and ``tuple[X, ...]``, which a list, range or array of X also fits; ``path``: a str
    field also takes an ``os.PathLike``). An integer fits ``float``; a bool fits only ``bool``."""
    import os
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h, path) for h in typing.get_args(hint))
    if origin is tuple:
        if isinstance(value, (str, bytes, dict)) or not (hasattr(value, "__len__") and hasattr(value, "__iter__")):
            return False
        return all(_fits(x, typing.get_args(hint)[0], path) for x in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if hint is int:
        return isinstance(value, numbers.Integral)
    if hint is float:
        return isinstance(value, numbers.Real)
    if hint is str:
        return isinstance(value, str) or (path and isinstance(value, os.PathLike))
    return True  # any other annotation is the experiment's own to check


def _describe(hint: Any) -> str:
    """``hint`` in words: ``a tuple of numbers or None``."""
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if origin is tuple:
        item = {int: "integers", float: "numbers", str: "strings"}.get(typing.get_args(hint)[0], "values")
        return f"a tuple of {item}"
    return {type(None): "None", bool: "True or False", int: "an integer", float: "a number",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


def check_types(cls: type, values: dict[str, Any]) -> None:
    """Each of ``values`` (field name -> value of the options dataclass ``cls``) of its field's annotated type, or
    one line naming the field (and its flag) before the dataclass's own checks compare or iterate it: the library's
    keywords (``eps="0.1"``, ``layers=3``), which the command line's parsing types."""
    import typing

    hints = typing.get_type_hints(cls)
    flags = {f.name: f.metadata["flag"].flag for f in dataclasses.fields(cls) if "flag" in f.metadata}
    for name, value in values.items():
        hint = hints.get(name)
        if hint is not None and not _fits(value, hint, path=name.endswith("_path")):
            flag = f" ({flags[name]})" if name in flags else ""
            raise MoetoolError(f"{cls.__name__} {name}{flag} must be {_describe(hint)}, not {value!r} "
                               f"({type(value).__name__})")


def kind_of(default: Any) -> str | None:
    """A :class:`Flag`'s kind from its field's default (``None``: not inferable, e.g. a default of ``None``)."""
    if isinstance(default, bool):
        return "bool"
    for cast, kind in ((int, "int"), (float, "float"), (str, "str")):
        if isinstance(default, cast):
            return kind
    if isinstance(default, (tuple, list)) and default and kind_of(default[0]) in ("int", "float", "str"):
        return kind_of(default[0]) + "s"
    return None


def option(default: Any = MISSING, flag: str | None = None, help: str = "", *, kind: str | None = None,
           shown: Any = None, default_factory: Any = MISSING, **flag_kw: Any) -> Any:
    """A field of an experiment's options dataclass (in its ``spec.py``) and, with ``flag``, the command's flag
    that sets it: ``top_tokens: int = option(10, "--top-tokens", "Most frequent token ids ...", min=0)``.

    ``kind`` defaults to the default's (:func:`kind_of`: a tuple of floats is ``floats``, a comma-separated list);
    the flag's default as ``--help`` shows it is the field's (a tuple joined by commas) or ``shown`` where the
    command line spells it otherwise (``--nodes all``); ``flag_kw`` are :class:`Flag`'s ``short``, ``min``,
    ``max``, ``required``, ``parse``, ``metavar``, ``inf`` (the flag takes ``inf``; NaN and infinity are refused
    otherwise). The field's default and the flag's cannot differ: one value."""
    kw: dict[str, Any] = {"default": default} if default_factory is MISSING else {"default_factory": default_factory}
    if flag is None:
        return field(**kw)
    value = default if default_factory is MISSING else default_factory()
    kind = kind or kind_of(value)
    if kind is None:
        raise ValueError(f"option {flag}: give kind= (its default {value!r} does not say)")
    if shown is None and value is not None:
        shown = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
    return field(**kw, metadata={"flag": Flag(flag, kind, shown, help, **flag_kw)})


def experiment(name: str, function: str, options: str | None, **kw: Any) -> Experiment:
    """The spec of the experiment in ``moetool/experiments/<name>/`` (``-`` as ``_``): its compute function is
    ``compute.py``'s ``function``. Its command is generated from the spec (``moetool <name>``); a module
    ``moetool.commands.<name>`` (``-`` as ``_``), where there is one, adds only what is the command's own (checks
    before loading, console output: :mod:`moetool.commands.generated`)."""
    module = f"moetool.experiments.{name.replace('-', '_')}.compute"
    spec_module = sys.modules.get(f"moetool.experiments.{name.replace('-', '_')}.spec")
    cls = vars(spec_module).get(options) if spec_module is not None and options else None
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):  # defined above the spec in its spec.py
        document_options(cls, name)
    return Experiment(name=name, module=module, function=function, options=options, api=kw.pop("api", function), **kw)


def document_options(cls: type, command: str) -> None:
    """Append to the options dataclass's docstring each field with its default and, where a flag of ``moetool
    <command>`` sets it (:func:`option`), the flag and its help: ``help(moetool.StatsOptions)`` says what each
    field does, in the words of ``--help``. Once per class (a spec module imported again leaves it)."""
    if "Fields (" in (cls.__doc__ or ""):
        return
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not MISSING else (f.default_factory() if f.default_factory is not MISSING
                                                              else None)
        flag = f.metadata.get("flag")
        how = f" (``{flag.flag}``): {flag.help}" if flag is not None else ""
        lines.append(f"* ``{f.name}`` = ``{default!r}``{how}")
    cls.__doc__ = (f"{inspect.cleandoc(cls.__doc__ or '')}\n\nFields (default; the flag of ``moetool {command}`` that "
                   f"sets it, where it has its own; the others are the standard flags ``--layers``, ``--batch-size``, "
                   f"...):\n\n" + "\n".join(lines))
