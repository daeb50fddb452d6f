"""`--help` text reads well at 80 columns: docstrings hard-wrapped in the source are re-flowed before rich wraps them."""



def test_reflow_joins_sentences_and_keeps_structure():
    from moetool.commands.app import reflow

    doc = ("First sentence runs\nover two lines.\n\nCache simulation: per layer\na cache.\n"
           "Intervals: 95% bootstrap\n(--bootstrap N).\n\n  load.csv: layer, expert,\n    load_fraction\n"
           "  layers.csv: layer\n\nExamples:\n  moetool stats\n  moetool stats --top-k 1\n")
    assert reflow(doc).splitlines() == [
        "First sentence runs over two lines.", "",
        "Cache simulation: per layer a cache.", "Intervals: 95% bootstrap (--bootstrap N).", "",
        "  load.csv: layer, expert, load_fraction", "  layers.csv: layer", "",
        "Examples:", "  moetool stats", "  moetool stats --top-k 1"]


def test_every_command_help_is_reflowed():
    from moetool.commands.app import app, reflow

    for info in app.registered_commands:
        assert info.help and reflow(info.help) == info.help, info.name
