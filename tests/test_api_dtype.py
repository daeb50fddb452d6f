"""``dtype`` of the Python API takes what torch calls the choices of ``--dtype`` (``torch.bfloat16``, ``"bfloat16"``,
``"half"``: :data:`moetool.loading.DTYPE_ALIASES`, one table), and its refusal lists what the API accepts; the command
line's stays as it was."""

from __future__ import annotations

import pytest
import torch

import moetool
from moetool.errors import MoetoolError


@pytest.mark.parametrize("dtype, want", [(torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         (torch.float16, torch.float16), ("float16", torch.float16),
                                         ("half", torch.float16), (torch.float32, torch.float32),
                                         ("float32", torch.float32), ("float", torch.float32),
                                         ("bf16", torch.bfloat16)])
def test_load_takes_torch_dtypes_and_their_long_names(dtype, want):
    """``load("tiny", dtype=torch.bfloat16)`` and ``dtype="bfloat16"`` were refused ("--dtype must be one of auto,
    bf16, fp16, fp32"): each is the same choice as its short name, the weights in that dtype."""
    got = moetool.load("tiny", dtype=dtype, tokenizer=False)
    assert {p.dtype for p in got.model.parameters()} == {want}


def test_a_run_by_name_records_a_torch_dtype_as_its_choice(tmp_path):
    """``moetool.run(..., dtype=torch.bfloat16)`` recorded ``'torch.bfloat16'`` in the manifest (a resume with
    ``dtype="bf16"`` would not have matched): the choice's own name, as the command records ``--dtype bf16``."""
    import json

    moetool.run("ppl", "tiny", dtype=torch.bfloat16, seq_len=16, max_tokens=64, bootstrap=0, quiet=True,
                out=tmp_path / "r")
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["options"]["dtype"] == "bf16"


def test_a_dtype_refused_lists_what_each_side_accepts(cli, tmp_path):
    with pytest.raises(MoetoolError) as e:
        moetool.load("tiny", dtype="int8")
    assert str(e.value) == ("dtype= must be one of auto, bf16, fp16, fp32, bfloat16, float16, half, float32, float "
                            "or a torch.dtype of them (torch.bfloat16, ...), not 'int8'")
    with pytest.raises(MoetoolError, match=r"not 'torch\.int8'$"):
        moetool.load("tiny", dtype=torch.int8)
    r = cli("ppl", "--model", "tiny", "--dtype", "int8", "--out", str(tmp_path / "never"))
    assert r.returncode == 2 and r.stderr.strip() == "error: --dtype must be one of auto, bf16, fp16, fp32, not 'int8'"
