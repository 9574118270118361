"""Every committed bench report is generated: each ``bench/results/<name>.md`` equals what its bench script renders
from ``<name>.json`` alone (bench/render_results.py picks the script by the name), so a hand edit, or a report left
stale after its data or its renderer changed, fails here, naming the file and the command that rewrites it."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
_spec = importlib.util.spec_from_file_location("bench_render_results", ROOT / "bench" / "render_results.py")
rr = importlib.util.module_from_spec(_spec)
sys.modules["bench_render_results"] = rr
_spec.loader.exec_module(rr)


@pytest.mark.parametrize("path", rr.pairs(RESULTS), ids=lambda p: p.stem)
def test_report_regenerates_from_its_json(path):
    md = path.with_suffix(".md")
    assert rr.render(path) == md.read_text(), \
        f"{md.relative_to(ROOT)} differs from its render: python bench/render_results.py {path.relative_to(ROOT)}"


def test_every_report_has_its_data():
    """No report without raw data beside it, and no raw data without a report (or a renderer)."""
    mds = {p.stem for p in RESULTS.glob("*.md")}
    jsons = {p.stem for p in RESULTS.glob("*.json")}
    assert not mds - jsons, f"reports with no .json to regenerate them from: {sorted(mds - jsons)}"
    assert not jsons - mds, f"results with no report: {sorted(jsons - mds)} (python bench/render_results.py)"
    assert len(rr.pairs(RESULTS)) == len(mds) > 0


def test_check_names_a_hand_edited_report(tmp_path, capsys):
    """``--check`` passes on a rendered pair, then fails naming the report once a number in it is typed over;
    the plain call rewrites it from the data."""
    src = RESULTS / "peers_cpu.json"
    data, md = tmp_path / src.name, tmp_path / "peers_cpu.md"
    data.write_text(src.read_text())
    md.write_text(rr.render(data))
    assert rr.main(["--check", str(data)]) == 0
    md.write_text(md.read_text().replace("| 256 | 0.051 |", "| 256 | 0.050 |"))
    assert rr.main(["--check", str(data)]) == 1
    assert str(md) in capsys.readouterr().out
    assert rr.main([str(data)]) == 0 and md.read_text() == rr.render(data)


def test_the_report_follows_the_data(tmp_path):
    """A changed measurement in the JSON changes the rendered report (the renderer reads the data, not a copy)."""
    raw = json.loads((RESULTS / "peers_cpu.json").read_text())
    raw["titans"][0]["ours"]["seconds"] = 1.234
    path = tmp_path / "peers_cpu.json"
    path.write_text(json.dumps(raw))
    text = rr.render(path)
    assert "| 256 | 1.234 |" in text and text != (RESULTS / "peers_cpu.md").read_text()


def test_unknown_results_file_is_named(tmp_path):
    path = tmp_path / "mystery_cpu.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="mystery_cpu.json.*known prefixes: learning_"):
        rr.render(path)


@pytest.mark.parametrize("script, name, write", [
    ("chunked.py", "chunked_cpu", lambda m, d: m.report(d["rows"], d["titans_2048"], d["gdn_2048_d32"], d["lengths"],
                                                        d["threads"], d["ns"])),
    ("peers.py", "peers_cpu", lambda m, d: m.report(d["fla_check"], d["gdn_2048_d32"], d["titans"])),
    ("search.py", "search_cpu", lambda m, d: m.write(d)),
])
def test_a_bench_run_writes_what_its_json_renders_to(script, name, write, tmp_path, monkeypatch):
    """The bench's own writer, fed the committed measurements, records every field its renderer reads: the report it
    writes is the one rendered from the JSON it writes (the machine fields are this machine's, so not compared with
    the committed report)."""
    module = rr._module(script)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    write(module, json.loads((RESULTS / f"{name}.json").read_text()))
    md = (tmp_path / f"{name}.md").read_text()
    assert md == rr.render(tmp_path / f"{name}.json")
