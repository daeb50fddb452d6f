"""The report page's logic on hand-made run folders: which runs are gathered and in what order, their names and
labels, the headline rows, status marks (mutation testing, part 7)."""

from __future__ import annotations

import json
from pathlib import Path

from moetool.report import page


def _run(folder: Path, command: str = "stats", model: str = "tiny", **more) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"command": command, "status": "complete",
                                                      "model": {"name": model}, "files": [], **more}))
    return folder


def test_sub_runs_in_their_manifests_order_and_an_unreadable_one_said(tmp_path):
    root = _run(tmp_path / "demo", "demo", runs=["zeta", "alpha"])
    for name in ("alpha", "zeta", "beta"):
        _run(root / name, name)
    (root / "broken").mkdir()
    (root / "broken" / "manifest.json").write_text("{not json")
    warned = []
    runs = page.find_runs([root], warn=warned.append)
    assert [r.rel for r in runs] == ["demo", "zeta", "alpha", "beta"]
    assert [r.manifest["command"] for r in runs] == ["demo", "zeta", "alpha", "beta"]
    assert len(warned) == 1 and "broken" in warned[0] and "not valid JSON" in warned[0]


def test_runs_whose_slugs_collide_get_unique_names_and_a_lone_run_shows_its_folder(tmp_path):
    root = tmp_path / "runs"
    _run(root / "a b")
    _run(root / "a-b")
    runs = page.find_runs([root])
    assert [r.name for r in runs] == ["runs-a-b", "runs-a-b_"]
    lone = page.find_runs([_run(tmp_path / "only")])
    assert [(r.name, r.rel) for r in lone] == [("only", "only")]


def test_files_are_sorted_into_figures_tables_and_others_by_place_and_suffix(tmp_path):
    r = _run(tmp_path / "r", files=["figures/a.png", "b.png", "load.csv", "trace.csv.gz", "notes.txt"])
    for f in ("figures/a.png", "b.png", "load.csv", "trace.csv.gz", "notes.txt"):
        (r / f).parent.mkdir(parents=True, exist_ok=True)
        (r / f).write_bytes(b"x\n")
    (run,) = page.find_runs([r])
    assert [p.name for p in run.figures] == ["a.png"] and [p.name for p in run.tables] == ["load.csv"]
    assert run.other == ["b.png", "trace.csv.gz", "notes.txt"]


def test_a_linked_manifest_is_not_gathered(tmp_path):
    real = _run(tmp_path / "real", files=["load.csv"])
    (real / "load.csv").write_text("a\n1\n")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "manifest.json").symlink_to(real / "manifest.json")
    warned = []
    assert page.find_runs([fake], warn=warned.append) == [] and "a symbolic link" in warned[0]


def test_headline_rows_name_the_model_and_mark_every_unfinished_status(tmp_path):
    body, md = [], []
    runs = [page.Run(tmp_path, f"r{i}", {"command": "ppl", "status": s, "model": {"name": "tiny-fine"},
                                         "headline": ["ppl 12.3"]})
            for i, s in enumerate(("complete", "interrupted", "running", None))]
    page._headlines(runs, body, md)
    rows = [ln for ln in md if ln.startswith("| [")]
    assert rows == ["| [ppl](#r0) | tiny-fine | ppl 12.3 |", "| [ppl (interrupted)](#r1) | tiny-fine | ppl 12.3 |",
                    "| [ppl (running)](#r2) | tiny-fine | ppl 12.3 |",
                    "| [ppl (status unknown)](#r3) | tiny-fine | ppl 12.3 |"]


def test_a_demo_without_headlines_falls_back_on_its_steps_linked_to_their_runs(tmp_path):
    demo = _run(tmp_path / "demo", "demo")
    sub = _run(demo / "stats", "stats", "tiny-early")
    m = json.loads((demo / "manifest.json").read_text())
    m["steps"] = [{"step": "stats", "summary": ["entropy 1.5"], "folders": [str(sub)]},
                  {"step": "inspect", "summary": ["4 experts"], "folders": []}]
    (demo / "manifest.json").write_text(json.dumps(m))
    runs = page.find_runs([demo])
    body, md = [], []
    page._headlines(runs, body, md)
    assert [ln for ln in md if ln.startswith("| [")] == [
        f"| [stats](#{runs[1].name}) | tiny-early | entropy 1.5 |", f"| [inspect](#{runs[0].name}) | tiny | 4 experts |"]


def test_an_unknown_status_is_styled_as_other(tmp_path):
    body, md = [], []
    page._run_header(page.Run(tmp_path, "r", {"command": "stats", "status": "paused"}), body, md)
    assert '<td class="status-other">paused</td>' in body[1]
    body = []
    page._run_header(page.Run(tmp_path, "r", {"command": "stats", "status": "failed"}), body, md)
    assert '<td class="status-failed">failed</td>' in body[1]


def test_counts_from_ten_thousand_get_separators():
    assert [page.human(v) for v in (9_999, 10_000, -10_000, 123_456)] == ["9999", "10,000", "-10,000", "123,456"]


def test_a_table_of_exactly_html_rows_is_shown_whole_and_crlf_is_not_cut_short(tmp_path):
    r = tmp_path / "r"
    _run(r, files=["t.csv"])
    rows = page.HTML_ROWS
    (r / "t.csv").write_bytes(("x\r\n" + "".join(f"{i}\r\n" for i in range(rows))).encode())
    out = tmp_path / "rep"
    html_page = page.write_report([r], out, warn=lambda m: None).read_text()
    assert html_page.count("<td class=\"n\">") == rows and f"{rows} rows; " in html_page
    assert "cut short" not in html_page


def test_a_folder_given_after_one_of_its_sub_runs_still_gathers_the_others(tmp_path):
    root = _run(tmp_path / "demo", "demo")
    _run(root / "a", "a")
    _run(root / "b", "b")
    warned = []
    runs = page.find_runs([root / "a", root], warn=warned.append)
    assert [r.manifest["command"] for r in runs] == ["a", "demo", "b"] and warned == []
    assert page.find_runs([root, root / "b"], warn=warned.append) and "already gathered" in warned[-1]


def test_the_index_lists_runs_with_content_and_says_an_unfinished_status(tmp_path):
    root = _run(tmp_path / "demo", "demo")  # complete, holding only sub-runs: not an entry of its own
    for name, status in (("a", "complete"), ("b", "interrupted"), ("c", "failed")):
        _run(root / name, name, files=["notes.txt"])
        (root / name / "notes.txt").write_text("x")
        m = json.loads((root / name / "manifest.json").read_text())
        (root / name / "manifest.json").write_text(json.dumps({**m, "status": status}))
    html_page = page.write_report([root], tmp_path / "rep", warn=lambda m: None).read_text()
    md = (tmp_path / "rep" / "report.md").read_text()
    index = md[md.index("## runs"):].split("\n\n")[1]
    assert index.splitlines() == ["- a · tiny (a)", "- b · tiny (b)", "- c · tiny (c)"]
    nav = html_page[html_page.index('<nav class="runs">'):html_page.index("</nav>")]
    assert nav.count("<li>") == 3 and ", interrupted</span>" in nav and ", failed</span>" in nav
    assert "a, complete" not in nav and 'class="note">a</span>' in nav


def test_an_out_that_contains_a_gathered_folder_is_refused(tmp_path):
    import pytest

    from moetool.errors import MoetoolError

    r = _run(tmp_path / "runs" / "r")
    for out, how in ((tmp_path / "runs", "contains"), (tmp_path, "contains"), (r, "is")):
        with pytest.raises(MoetoolError, match=f"--out {out} {how} the folder"):
            page.refuse_out_over_runs(out, [r])
    page.refuse_out_over_runs(tmp_path / "elsewhere", [r])


def test_a_table_with_fewer_rows_than_its_run_wrote_is_not_shown(tmp_path):
    r = _run(tmp_path / "r", files=["t.csv"])
    (r / "t.csv").write_text("x\n1\n2\n")
    m = json.loads((r / "manifest.json").read_text())
    (r / "manifest.json").write_text(json.dumps({**m, "tables": {"t.csv": {"rows": 3, "bytes": 8}}}))
    html_page = page.write_report([r], tmp_path / "rep", warn=lambda m: None).read_text()
    assert "t.csv: not shown (it has 2 rows, the run wrote 3" in html_page and '<td class="n">' not in html_page


def test_headline_rows_of_one_experiment_say_the_options_their_runs_differ_in(tmp_path):
    """Break-it run 5: `moetool ppl --max-tokens 512` and the same with `--seq-len 16` gathered side by side showed
    `| ppl | tiny | ... perplexity 52.1 ... |` and `| ppl | tiny | ... perplexity 70 ... |`: two perplexities of one
    model at other context lengths, compared in one table as if alike. Each row now names the options in which its
    run differs from the other runs of the same experiment (seq_len here, data and dtype below); a run alone, or
    runs agreeing, show the model only; another experiment's options are not compared."""
    def ppl(name, **opts):
        return page.Run(tmp_path, name, {"command": "ppl", "status": "complete", "model": {"name": "tiny"},
                                         "headline": [f"ppl {name}"], "data": {"source": "heldout.jsonl"},
                                         "options": {"model": "tiny", "data": None, "seq_len": 256, "dtype": "auto",
                                                     "batch_size": 8, **opts}})
    runs = [ppl("a"), ppl("b", seq_len=16), ppl("c", data="other.jsonl", dtype="bfloat16"),
            ppl("d", data="heldout.jsonl", seq_len=16),  # the text read by default, named: the same data
            page.Run(tmp_path, "s", {"command": "stats", "status": "complete", "model": {"name": "tiny"},
                                     "headline": ["entropy 1.5"], "options": {"model": "tiny", "seq_len": 16}}),
            page.Run(tmp_path, "t", {"command": "stats", "status": "complete", "model": {"name": "tiny-fine"},
                                     "headline": ["entropy 1.2"], "options": {"model": "tiny-fine", "seq_len": 16}}),
            page.Run(tmp_path, "u", {"command": "stats", "status": "failed", "model": {"name": "tiny"},
                                     "headline": ["entropy 1.4"]})]  # failed before recording its options
    body, md = [], []
    page._headlines(runs, body, md)
    rows = [ln for ln in md if ln.startswith("| [")]
    assert rows == ["| [ppl](#a) | tiny · data=heldout.jsonl, seq\\_len=256, dtype=auto | ppl a |",
                    "| [ppl](#b) | tiny · data=heldout.jsonl, seq\\_len=16, dtype=auto | ppl b |",
                    "| [ppl](#c) | tiny · data=other.jsonl, seq\\_len=256, dtype=bfloat16 | ppl c |",
                    "| [ppl](#d) | tiny · data=heldout.jsonl, seq\\_len=16, dtype=auto | ppl d |",
                    "| [stats](#s) | tiny | entropy 1.5 |", "| [stats](#t) | tiny-fine | entropy 1.2 |",
                    "| [stats (failed)](#u) | tiny | entropy 1.4 |"]
    assert "<td>tiny · data=heldout.jsonl, seq_len=16, dtype=auto</td>" in "".join(body)
    body, md = [], []
    page._headlines([runs[1], runs[3]], body, md)  # the shipped text by default and by name: nothing differs
    assert [ln for ln in md if ln.startswith("| [")] == ["| [ppl](#b) | tiny | ppl b |", "| [ppl](#d) | tiny | ppl d |"]
    body, md = [], []
    page._headlines(runs[:1], body, md)
    assert [ln for ln in md if ln.startswith("| [")] == ["| [ppl](#a) | tiny | ppl a |"]


def test_a_demo_step_beside_the_same_command_differs_only_in_what_both_record(tmp_path):
    """A newcomer's ``moetool report runs/stats-tiny runs/demo-*`` said the demo's stats ran with
    ``data=none, max_tokens=8192, dtype=none, device=none, special_tokens=none`` beside the command's
    ``data=.../heldout.jsonl, max_tokens=4096, dtype=auto, device=auto, special_tokens=tokenizer default``: both read
    the shipped text in fp32 on the CPU; the demo step records no dtype, device or special_tokens option and its
    data only in the manifest's ``data``. Now only max_tokens, the one option both record with other values."""
    src = "/site-packages/moetool/embedded/data/heldout.jsonl"
    cli = {"model": "tiny", "data": None, "seq_len": 256, "max_tokens": 4096, "dtype": "auto", "device": "auto",
           "device_map": None, "special_tokens": "tokenizer default", "top_tokens": 10, "batch_size": 8,
           "bootstrap": 1000, "seed": 0, "layers": None}
    demo = {"model": "tiny", "seq_len": 256, "max_tokens": 8192, "add_special_tokens": None, "top_tokens": 10,
            "batch_size": 8, "bootstrap": 1000, "seed": 0, "layers": None}

    def stats(name, opts, tokens):
        return page.Run(tmp_path, name, {"command": "stats", "status": "complete", "model": {"name": "tiny"},
                                         "headline": [f"stats {name}"], "options": opts,
                                         "data": {"source": src, "tokens": tokens}})
    body, md = [], []
    page._headlines([stats("cli", cli, 4096), stats("demo", demo, 8192)], body, md)
    assert [ln for ln in md if ln.startswith("| [")] == ["| [stats](#cli) | tiny · max\\_tokens=4096 | stats cli |",
                                                         "| [stats](#demo) | tiny · max\\_tokens=8192 | stats demo |"]
    body, md = [], []  # other text read: the demo's data (from its manifest) is named beside the command's
    page._headlines([stats("cli", {**cli, "data": "mine.jsonl", "max_tokens": 8192}, 8192),
                     stats("demo", demo, 8192)], body, md)
    assert [ln for ln in md if ln.startswith("| [")] == [
        "| [stats](#cli) | tiny · data=mine.jsonl | stats cli |", f"| [stats](#demo) | tiny · data={src} | stats demo |"]


def test_a_run_over_too_few_rows_for_a_95_interval_says_so_in_the_page(tmp_path):
    """The manifest's bootstrap note (uncertainty.few_rows_note, fewer than FEW_ROWS rows) beside the headline
    numbers and in the run's summary; a run of enough rows shows neither."""
    from moetool.uncertainty import bootstrap_meta

    few, enough = bootstrap_meta(1000, 0, 4), bootstrap_meta(1000, 0, 64)
    runs = [page.Run(tmp_path, f"r{i}", {"command": "ppl", "status": "complete", "model": {"name": "tiny"},
                                         "headline": ["ppl 12.3 ± 0.4"], "bootstrap": b})
            for i, b in enumerate((few, enough))]
    body, md = [], []
    page._headlines(runs, body, md)
    rows = [ln for ln in md if ln.startswith("| [")]
    assert rows == [f"| [ppl](#r0) | tiny | ppl 12.3 ± 0.4<br>note: {page.md_escape(few['note'])} |",
                    "| [ppl](#r1) | tiny | ppl 12.3 ± 0.4 |"]
    assert few["note"].startswith("4 packed rows: ")
    assert ("intervals", few["note"]) in page.summary(runs[0].manifest)
    assert not [k for k, _ in page.summary(runs[1].manifest) if k == "intervals"]


def test_a_file_its_run_wrote_but_that_is_gone_is_said_not_dropped_in_silence(tmp_path):
    """Break-it run 18: a run folder with a CSV (or a figure) deleted by hand was gathered as if the run had never
    written it -- the page showed the other tables and not a word about the missing one; a run whose every file was
    gone vanished from the index. Now each run's section names the files its manifest lists that are missing."""
    r = _run(tmp_path / "runs" / "a", files=["load.csv", "layers.csv", "figures/load_heatmap.png"])
    (r / "load.csv").write_text("layer,x\n0,1\n")
    empty = _run(tmp_path / "runs" / "b", "ppl", files=["ppl.csv"])  # its only table deleted
    html_page = page.write_report([r, empty], tmp_path / "rep", warn=lambda m: None).read_text()
    md = (tmp_path / "rep" / "report.md").read_text()
    for text in (html_page, md):
        assert text.count("missing from its folder") == 2
        assert "not shown: layers.csv, figures/load_heatmap.png" in text.replace("\\_", "_")
        assert "not shown: ppl.csv" in text
    assert "- ppl · tiny (b)" in md  # still in the index
    assert "<h3 id=\"a--tab-load\">load.csv</h3>" in html_page  # the table that is there is shown


def test_with_two_folders_given_every_run_shows_the_folder_it_came_from(tmp_path):
    """One folder given: its sub-runs show their path inside it ("zeta"); two folders given: every run shows its
    root's name too ("one/sub"), so runs of the same sub-folder name under the two roots are told apart."""
    one = _run(tmp_path / "one", "demo", runs=["sub"])
    _run(one / "sub", "ppl")
    two = _run(tmp_path / "two", "demo", runs=["sub"])
    _run(two / "sub", "ppl")
    assert [r.rel for r in page.find_runs([one])] == ["one", "sub"]
    assert [r.rel for r in page.find_runs([one, two])] == ["one", "one/sub", "two", "two/sub"]


def test_the_excluded_folder_and_what_is_under_it_are_not_gathered(tmp_path):
    """``exclude`` (the report's own output folder) is never gathered, whatever its manifest says, nor a run
    inside it; the other runs are."""
    root = _run(tmp_path / "runs", "demo")
    _run(root / "a", "ppl")
    out = _run(root / "out", "stats")
    _run(out / "inner", "erc")
    assert [r.rel for r in page.find_runs([root])] == ["runs", "a", "out", "out/inner"]
    assert [r.rel for r in page.find_runs([root], exclude=out)] == ["runs", "a"]


def test_a_manifest_entry_naming_the_run_folder_itself_is_refused_and_an_unfinished_parent_is_listed(tmp_path):
    """``.`` (the run folder itself) is no file of the run: refused and said, like a path outside it. A parent run
    with no files of its own is an entry of the index only when it did not complete (its status is news)."""
    r = _run(tmp_path / "r", files=[".", "load.csv"])
    (r / "load.csv").write_text("a\n1\n")
    warned = []
    run, = page.find_runs([r], warn=warned.append)
    assert run.refused == ["."] and [p.name for p in run.tables] == ["load.csv"] and len(warned) == 1
    assert page.Run(r, "r", {"status": "running"}).has_content
    assert not page.Run(r, "r", {"status": "complete"}).has_content
