"""The same run folder gives the same report, byte for byte.

``tests/search/data/report_run`` is a run folder kept as ``atlaslab run tests/search/data/report_fixture.yaml``
wrote it (a two-variant × two-seed MQAR grid; Tune's own folder left out): its inputs (the experiment, state,
trials and ``results.json``) and the report the run wrote (``report.md``, ``report.csv``, ``trials.csv``,
``curves.csv``). The test writes the report again from the inputs alone (``atlaslab report``'s path) and compares
every file with the committed one. The plots are drawn too; their names are compared, not their bytes (a PNG
carries the matplotlib version that drew it). A change to what a report prints fails here; a deliberate one is
committed together with the folder's report regenerated (``atlaslab report tests/search/data/report_run``).
"""
import shutil
from pathlib import Path

from atlaslab.search.report import report_from_dir

RUN = Path(__file__).parent / "data" / "report_run"
INPUTS = ("experiment.yaml", "state.json", "trials.json", "results.json")
REPORT = ("report.md", "report.csv", "trials.csv", "curves.csv")
PLOTS = ("bar_test_accuracy.png", "bar_val_accuracy.png", "curves.png")


def test_a_committed_run_folder_gives_its_committed_report_byte_for_byte(tmp_path):
    run = tmp_path / RUN.name
    run.mkdir()
    for name in INPUTS:
        shutil.copyfile(RUN / name, run / name)
    assert report_from_dir(run) == run / "report.md"
    for name in REPORT:
        assert (run / name).read_bytes() == (RUN / name).read_bytes(), f"{name} differs from the committed report"
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(PLOTS)
    assert all(f"(plots/{name})" in (run / "report.md").read_text() for name in PLOTS)
