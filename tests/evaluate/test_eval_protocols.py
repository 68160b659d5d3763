"""Per-dataset protocols (JSON-able dicts) and the paper-style markdown tables."""

import json

import numpy as np
import pytest

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate import evaluate_cub200, evaluate_sop, evaluate_vehicleid, paper_tables
from caffe_compat.evaluate.protocols import reid_table, retrieval_table


def clustered(classes, per_class, dim, noise, seed):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), per_class)
    return (np.eye(dim)[labels] + noise * rng.normal(size=(len(labels), dim))).astype(np.float32), labels


def test_cub200_protocol_on_perfect_features_round_trips_json():
    x, y = clustered(8, 5, 16, 0.01, 0)
    result = evaluate_cub200(x, y, seed=0)
    assert result["recall_at_k"] == {"1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0, "16": 1.0, "32": 1.0}
    assert result["map_at_r"] == 1.0 and result["precision_at_1"] == 1.0
    assert result["nmi"] == pytest.approx(1.0, abs=1e-12)
    assert result["num_images"] == 40 and result["protocol"] == "cub200"
    assert json.loads(json.dumps(result)) == result


def test_sop_protocol_keys_and_values_match_metrics():
    from caffe_compat.evaluate import map_at_r, recall_at_k

    x, y = clustered(30, 3, 32, 0.5, 1)
    result = evaluate_sop(x, y)
    assert list(result["recall_at_k"]) == ["1", "10", "100", "1000"]
    expected = recall_at_k(x, y, (1, 10, 100, 1000))
    assert result["recall_at_k"] == {str(k): v for k, v in expected.items()}
    assert result["recall_at_k"]["100"] == 1.0  # 89 other items: every query's match is within 100
    assert result["map_at_r"] == map_at_r(x, y)
    assert "nmi" not in result
    assert json.loads(json.dumps(result)) == result


def test_vehicleid_protocol_per_split():
    small = clustered(10, 3, 16, 0.01, 2)
    medium = clustered(12, 2, 16, 0.6, 3)
    result = evaluate_vehicleid({"small": small, "medium": medium}, repeats=4, seed=1)
    assert set(result["splits"]) == {"small", "medium"}
    assert result["splits"]["small"]["top_1"] == {"mean": 1.0, "std": 0.0}
    assert result["splits"]["small"]["num_vehicles"] == 10 and len(result["splits"]["small"]["cmc"]) == 10
    from caffe_compat.evaluate import vehicleid_cmc

    top = vehicleid_cmc(*medium, repeats=4, seed=1)
    assert result["splits"]["medium"]["top_5"] == {"mean": top[5][0], "std": top[5][1]}
    assert json.loads(json.dumps(result)) == result
    with pytest.raises(CaffeCompatError, match="splits"):
        evaluate_vehicleid({"huge": small})
    singletons = (np.eye(3), np.arange(3))  # every vehicle once: that list has no query
    with pytest.raises(CaffeCompatError, match="^VehicleID medium test list: every vehicle has a single image"):
        evaluate_vehicleid({"small": small, "medium": singletons})


def paper_rows():
    """The paper's Histogram and Ours^0.01 rows, as protocol dicts."""
    def cub(values, nmi=None):
        d = {"recall_at_k": {str(k): v / 100 for k, v in zip((1, 2, 4, 8, 16, 32), values)}}
        if nmi is not None:
            d["nmi"] = nmi / 100
        return d

    def sop(values):
        return {"recall_at_k": {str(k): v / 100 for k, v in zip((1, 10, 100, 1000), values)}}

    def vid(values):
        names = ("small", "medium", "large")
        return {"splits": {n: {"top_1": {"mean": a / 100, "std": 0.004}, "top_5": {"mean": b / 100, "std": 0.0}}
                           for n, (a, b) in zip(names, zip(values[::2], values[1::2]))}}

    return {
        "Histogram [10]": {"cub200": cub([50.3, 61.9, 72.6, 82.4, 88.8, 93.7]), "sop": sop([63.9, 81.7, 92.2, 97.7]),
                           "vehicleid": vid([49.3, 70.9, 43.7, 65.1, 39.5, 59.9])},
        "Ours 0.01": {"cub200": cub([50.4, 62.6, 74.8, 84.0, 90.5, 94.9], nmi=60.25)},
    }


def test_table_1_layout():
    assert retrieval_table(paper_rows()).splitlines() == [
        "| Method | CUB-200-2011 R@1 | R@2 | R@4 | R@8 | R@16 | R@32 | NMI | Stanford Online Products R@1 | R@10 | R@100 | R@1000 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| Histogram [10] | 50.3 | 61.9 | 72.6 | 82.4 | 88.8 | 93.7 | / | 63.9 | 81.7 | 92.2 | 97.7 |",
        "| Ours 0.01 | 50.4 | 62.6 | 74.8 | 84.0 | 90.5 | 94.9 | 60.2 | / | / | / | / |",
    ]


def test_table_2_layout_and_both_tables():
    assert reid_table(paper_rows(), with_std=True).splitlines() == [
        "| Method | Small Top 1 | Small Top 5 | Medium Top 1 | Medium Top 5 | Large Top 1 | Large Top 5 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| Histogram [10] | 49.3 ± 0.4 | 70.9 ± 0.0 | 43.7 ± 0.4 | 65.1 ± 0.0 | 39.5 ± 0.4 | 59.9 ± 0.0 |",
        "| Ours 0.01 | / | / | / | / | / | / |",
    ]
    text = paper_tables(paper_rows())
    assert text.startswith("Table 1. Recall@K (%)") and "\n\nTable 2. Match rate (%)" in text
    assert "| Histogram [10] | 49.3 | 70.9 | 43.7 | 65.1 | 39.5 | 59.9 |" in text
    with pytest.raises(CaffeCompatError):
        paper_tables({"nothing": {}})
