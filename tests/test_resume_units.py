"""``moetool.checkpoints.Units`` in process: which options and inputs a resume compares (values, not just names),
what the refusal names, damaged units and side files, numpy scalars kept as their own type, the pacing of batch
checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetool import checkpoints
from moetool.errors import MoetoolError, MoetoolRuntimeError
from moetool.report import rundir


def _interrupted(tmp_path, key, **inputs):
    """A run with ``key`` options that saved one unit after recording ``inputs``, then was interrupted; returns its
    resumed RunDir."""
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units(key)
    if inputs:
        units.check_inputs(**inputs)
    units.save("batches", {"n": 1})
    run.mark("interrupted")
    return rundir.RunDir.create("stats", tmp_path / "r", resume=True)


def test_resume_compares_the_option_values_and_names_each_that_changed(tmp_path):
    """Same option names, other values: refused, every changed one named (old -> new), the unchanged ones not."""
    again = _interrupted(tmp_path, {"top_k": 2, "seed": 0, "routing": "router"})
    with pytest.raises(MoetoolError, match=r"started with other options \(seed: 0 -> 1, top_k: 2 -> 3\); rerun"):
        again.units({"top_k": 3, "seed": 1, "routing": "router"})
    with pytest.raises(MoetoolError, match=r"other options \(eps: None -> 0.5\); rerun"):  # an option added
        again.units({"top_k": 2, "seed": 0, "routing": "router", "eps": 0.5})
    assert again.units({"top_k": 2, "seed": 0, "routing": "router"}).load("batches") == {"n": 1}
    again.mark("interrupted")


def test_resume_refuses_other_data_and_names_where_it_differs(tmp_path):
    """Another data fingerprint is refused (the place named); the same one, or one the run never recorded, passes."""
    again = _interrupted(tmp_path, {"a": 1}, data={"rows": 8, "sha256": "aa"})
    units = again.units({"a": 1})
    with pytest.raises(MoetoolError, match=r"the data changed since .*\(data.sha256: 'aa' -> 'bb'\)"):
        units.check_inputs(data={"rows": 8, "sha256": "bb"})
    units.check_inputs(data={"rows": 8, "sha256": "aa"}, model={"source": "tiny"})  # model: not recorded before
    again.mark("interrupted")


def test_a_changed_checkpoint_among_several_is_named_by_its_place(tmp_path):
    """Checkpoints runs record a list of weight fingerprints: the one that changed is named by its index."""
    again = _interrupted(tmp_path, {"a": 1}, model=[{"bytes": 10}, {"bytes": 20}])
    with pytest.raises(MoetoolError, match=r"the model's weights changed since .*\(model\[1\]\.bytes: 20 -> 21\)"):
        again.units({"a": 1}).check_inputs(model=[{"bytes": 10}, {"bytes": 21}])
    again.mark("interrupted")


def _resumed_load_refused(tmp_path, match):
    """The run in ``tmp_path / "r"`` resumed: loading its ``batches`` unit is refused with ``match``."""
    again = rundir.RunDir.create("stats", tmp_path / "r", resume=True)
    with pytest.raises(MoetoolRuntimeError, match=match):
        again.units({"a": 1}).load("batches")
    again.mark("interrupted")


def test_a_side_file_grown_since_its_unit_is_damage(tmp_path):
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    side = units.file("rows-0.bin")
    side.write_bytes(b"x" * 10)
    units.save("batches", {"n": 1})
    run.mark("interrupted")
    side.write_bytes(b"x" * 12)  # appended to: not what the unit recorded
    _resumed_load_refused(tmp_path, "damaged or unsafe .its file rows-0.bin has 12 bytes, not 10")


def test_a_back_reference_past_the_end_is_damage_not_an_index_error(tmp_path):
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    units.save("batches", {"n": 1})
    torch.save({"format": checkpoints.UNIT_FORMAT, "files": {}, "unit": {"__t": "same", "i": 0}},
               tmp_path / "r" / "units" / "batches.unit")  # nothing decoded before it: index 0 is past the end
    run.mark("interrupted")
    _resumed_load_refused(tmp_path, "damaged or unsafe .back-reference 0 out of range")


def test_numpy_scalars_and_slices_come_back_as_they_were(tmp_path):
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    big = np.int64(2 ** 53 + 1)  # not exact as a float64
    units.save("u", [big, np.float32(0.1), np.int32(-7), np.bool_(True), slice(0, 10, 2)])
    run.mark("interrupted")
    again = rundir.RunDir.create("stats", tmp_path / "r", resume=True)
    back = again.units({"a": 1}).load("u")
    assert [type(v) for v in back] == [np.int64, np.float32, np.int32, np.bool_, slice]
    assert back[0] == 2 ** 53 + 1 and back[1] == np.float32(0.1) and back[2] == -7 and back[3]
    assert back[4] == slice(0, 10, 2) and list(range(10))[back[4]] == [0, 2, 4, 6, 8]
    again.mark("interrupted")


def test_a_batch_checkpoint_is_due_once_every_seconds_have_passed(tmp_path, monkeypatch):
    """``every_seconds = 0``: after every batch, even when the clock has not moved; 60: from 60 s on."""
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    now = units._last
    monkeypatch.setattr(checkpoints.time, "monotonic", lambda: now)
    monkeypatch.setattr(units, "every_seconds", 0.0)
    assert units.due()
    monkeypatch.setattr(units, "every_seconds", 60.0)
    assert not units.due()
    monkeypatch.setattr(checkpoints.time, "monotonic", lambda: now + 60.0)
    assert units.due()
    monkeypatch.setattr(checkpoints.time, "monotonic", lambda: now + 59.5)
    assert not units.due()
    run.mark("interrupted")


def test_a_unit_of_another_layout_version_is_damage(tmp_path):
    """A unit file whose ``format`` is not this moetool's UNIT_FORMAT (another layout of ``unit``, whatever its
    entries look like) is refused in one line, never decoded as if it were this layout."""
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    units.save("batches", {"n": 1})
    for fmt in (checkpoints.UNIT_FORMAT + 1, None):
        torch.save({"format": fmt, "files": {}, "unit": {"__t": "dict", "k": ["n"], "v": [1]}},
                   tmp_path / "r" / "units" / "batches.unit")
        run.mark("interrupted")
        _resumed_load_refused(tmp_path, "damaged or unsafe .not a moetool unit")


def test_empty_numpy_arrays_come_back_empty(tmp_path):
    """An empty array (a table's rows of a run that saw none yet) is stored with one placeholder byte: it comes back
    with its shape and dtype, not refused as damage (the placeholder is no element)."""
    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    units.save("u", [np.zeros((0, 3)), np.zeros(0, dtype=np.int8), np.arange(3, dtype=np.int16)])
    run.mark("interrupted")
    again = rundir.RunDir.create("stats", tmp_path / "r", resume=True)
    back = again.units({"a": 1}).load("u")
    assert [(b.shape, b.dtype) for b in back] == [((0, 3), np.float64), ((0,), np.int8), ((3,), np.int16)]
    assert back[2].tolist() == [0, 1, 2]
    again.mark("interrupted")


def test_a_file_still_being_written_is_no_side_file_of_a_unit(tmp_path):
    """A ``.part-`` file handed out by ``file`` (one being written atomically: renamed away when done) is not
    recorded with the unit: its absence on resume is no damage, while a real side file's is."""
    from moetool.files import PART

    run = rundir.RunDir.create("stats", tmp_path / "r")
    units = run.units({"a": 1})
    part = units.file(PART + "rows.bin")
    part.write_bytes(b"x" * 5)
    units.save("batches", {"n": 1})
    part.unlink()  # the write finished: the temporary name is gone
    run.mark("interrupted")
    again = rundir.RunDir.create("stats", tmp_path / "r", resume=True)
    assert again.units({"a": 1}).load("batches") == {"n": 1}
    again.mark("interrupted")
