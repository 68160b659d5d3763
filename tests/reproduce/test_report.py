"""What `reproduce digits` reports: the data set it used by name, ± as the sample standard deviation
over seeds (ddof=1) in results.md, results.json and run.json, MAP@R in results.md; the numbers are
checked against each run's own metrics.json."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from caffe_compat.evaluate.protocols import paper_tables
from caffe_compat.reproduce.report import results_markdown, seed_spread
from caffe_compat.reproduce.setups import SETUPS


def per_seed(out, loss: str, key: str) -> np.ndarray:
    """``key`` ("map_at_r" or a Recall@K "1", "2", ...) of each seed's metrics.json, in percent."""
    values = []
    for seed in (0, 1):
        metrics = json.loads((out / loss / f"seed{seed}" / "metrics.json").read_text())["metrics"]
        values.append(metrics[key] if key == "map_at_r" else metrics["recall_at_k"][key])
    return 100 * np.asarray(values)


def table_rows(markdown: str) -> dict:
    """``{loss: {column: cell}}`` of results.md's table over seeds (the one with a ``seeds`` column)."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| Method | seeds |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_sample_std_is_ddof_1_and_none_for_one_seed():
    spread = seed_spread([0.1, 0.2, 0.3])
    assert spread["n"] == 3 and spread["mean"] == pytest.approx(0.2) and spread["std"] == pytest.approx(0.1)
    assert seed_spread([0.4])["std"] is None


def test_table_names_the_digits_set_not_cub(digits_run):
    out, _ = digits_run
    text = (out / "results.md").read_text()
    assert text.startswith("# digits, CUB layout: 6 iterations per run")
    assert "| Method | digits, CUB layout R@1 | R@2 |" in text and "CUB-200-2011 R@1" not in text
    assert "It is not CUB-200-2011" in text


@pytest.mark.parametrize("dataset, name", [("cub200", "CUB-200-2011"), ("sop", "Stanford Online Products"),
                                           ("vehicleid", "VehicleID"), ("digits", "digits, CUB layout")])
def test_real_data_sets_keep_their_names(dataset, name):
    setup = SETUPS[dataset]
    assert setup.display_name == name
    if setup.protocol != "vehicleid":
        result = {"recall_at_k": {"1": 0.5}, "nmi": 0.6}
        table = paper_tables({"m": {setup.protocol: result}}, titles={setup.protocol: setup.display_name})
        assert f"| Method | {name} R@1 |" in table


def test_results_md_shows_map_at_r_and_sample_std(digits_run):
    out, _ = digits_run
    text = (out / "results.md").read_text()
    assert "± = sample standard deviation over n = 2 seeds (0, 1; ddof = 1)." in text
    rows = table_rows(text)
    assert set(rows) == {"fappy", "triplet"}
    distinguishes = False  # at least one cell where ddof=0 would have printed something else
    for loss, row in rows.items():
        assert row["seeds"] == "2"
        for column, key in (("Recall@1", "1"), ("MAP@R", "map_at_r")):
            values = per_seed(out, loss, key)
            assert row[column] == f"{values.mean():.1f} ± {values.std(ddof=1):.1f}", (loss, column)
            distinguishes |= f"{values.std(ddof=1):.1f}" != f"{values.std(ddof=0):.1f}"
        assert row["Recall@1 per seed"] == ", ".join(f"{v:.1f}" for v in per_seed(out, loss, "1"))
    assert distinguishes


def test_results_json_and_run_json_hold_the_same_sample_std(digits_run):
    out, _ = digits_run
    results = json.loads((out / "results.json").read_text())
    run = json.loads((out / "run.json").read_text())
    assert results["data_set"] == "digits, CUB layout" and "ddof=1" in results["spread"] and "ddof=1" in run["spread"]
    for loss in ("fappy", "triplet"):
        entry = results["losses"][loss]
        assert [r["seed"] for r in entry["runs"]] == [0, 1]
        assert all("map_at_r" in r["metrics"] for r in entry["runs"])
        for key, summary in (("map_at_r", entry["summary"]["map_at_r"]), ("1", entry["summary"]["recall_at_1"]),
                             ("4", entry["summary"]["recall_at_k"]["4"])):
            values = per_seed(out, loss, key) / 100
            assert summary["n"] == 2 and summary["per_seed"] == pytest.approx(values)
            assert summary["mean"] == pytest.approx(values.mean()) and summary["std"] == pytest.approx(values.std(ddof=1))
        figure = run["figures"][loss]
        assert figure["std"] == pytest.approx(per_seed(out, loss, "1").std(ddof=1) / 100)


def test_one_seed_shows_no_spread(digits_run):
    """Built from the first seed of the digits run: no ± anywhere, a line saying why."""
    out, _ = digits_run
    results = json.loads((out / "results.json").read_text())
    runs = {loss: entry["runs"][:1] for loss, entry in results["losses"].items()}
    text = results_markdown(SETUPS["digits"], runs, max_iter=6, seeds=[0])
    assert "One seed (0): no spread over seeds is shown" in text and "±" not in text
    row = table_rows(text)["fappy"]
    assert row["MAP@R"] == f"{per_seed(out, 'fappy', 'map_at_r')[0]:.1f}"
    assert re.fullmatch(r"\d+\.\d", row["Recall@1"])
