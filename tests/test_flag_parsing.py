"""Flag values as the commands parse them (``commands.options``, ``commands.cli``): paths, comma lists, --layers
spans, --batch-size -- each against the list written out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from moetool.errors import MoetoolError


def test_a_path_of_blanks_is_refused_like_an_empty_one():
    """``--data " "`` (a variable holding a space) is no file name either: refused, not Path(" ")."""
    from moetool.commands.options import parse_path

    for blank in ("", " ", "  \t"):
        with pytest.raises(typer.BadParameter, match="an empty path"):
            parse_path(blank)
    assert parse_path("runs/x") == Path("runs/x") and parse_path(Path(" ")) == Path(" ")  # a Path is taken as is


def test_an_empty_item_anywhere_in_a_list_is_skipped_not_the_end():
    """``0,,2`` and ``,1,`` (a doubled or stray comma): every value after the empty item is kept."""
    from moetool.commands.cli import parse_list

    assert parse_list("0,,2", int, "k") == [0, 2]
    assert parse_list(",1,", int, "k") == [1]
    assert parse_list("0.5, ,0.25,", float, "--eps") == [0.5, 0.25]


def test_layers_are_sorted_once_each_up_to_the_largest_index():
    """``5,0-2,1`` -> 0, 1, 2, 5 (model order, each once); layer 100,000 is taken, 100,001 refused."""
    from moetool.commands.cli import MAX_LAYER, parse_layers

    assert parse_layers("5,0-2,1") == (0, 1, 2, 5)
    assert parse_layers("3,3-4,,4") == (3, 4)
    assert MAX_LAYER == 100_000 and parse_layers("100000") == (100_000,)
    assert parse_layers("99998-100000") == (99_998, 99_999, 100_000)
    with pytest.raises(MoetoolError, match="layer 100001 is beyond any model's layers"):
        parse_layers("100001")
