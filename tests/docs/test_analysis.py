"""The notebook-style analysis of docs/analysis.md runs on the committed sweep and prints what the page shows, and
its table equals the recall-against-state page's rows (mean ± std over the seeds)."""
import contextlib
import io
import os
import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_the_analysis_example_prints_what_the_page_shows():
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)                          # the page runs it from the repository root
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(DOCS / "analysis_example.py"), run_name="__main__")
    finally:
        os.chdir(cwd)
    assert out.getvalue() == (DOCS / "analysis_example.txt").read_text(), \
        "regenerate: python docs/analysis_example.py > docs/analysis_example.txt"
    page = (DOCS / "analysis.md").read_text()
    for name in ("analysis_example.py", "analysis_example.txt", "analysis_curves_example.py"):
        assert f'--8<-- "docs/{name}"' in page


def test_the_example_table_is_the_results_page_table():
    import atlaslab
    df = atlaslab.load_results(DOCS / "results" / "recall-vs-state" / "runs" / "rvs_wd")
    df["heads"] = df["params"].map(lambda p: p["model.mixers.*.num_heads"])
    page = (DOCS / "results" / "recall-vs-state.md").read_text()
    rows = re.findall(r"^\| (.+?) · (\d+) \| [\d,]+ \| ([\d.]+) ± ([\d.]+) \(.*?\) \| 3 \| rvs_wd \|$", page, re.M)
    assert len(rows) == 9
    for variant, heads, mean, std in rows:
        acc = df[(df["variant"] == variant) & (df["heads"] == int(heads))]["test/accuracy"]
        assert len(acc) == 3
        assert f"{acc.mean():.3f}" == mean and f"{acc.std():.3f}" == std, (variant, heads)
