"""scripts/compare_runs.py's paired bootstrap: folds are resampled separately, and runs that share
their validation images (two seeds of one fold) are resampled together, not as independent folds."""
from __future__ import annotations

import numpy as np

from scripts_under_test import load_script


def _interval(row: str) -> tuple[float, float]:
    low, high = row.split("[")[1].split("]")[0].split(", ")
    return float(low.rstrip("%")), float(high.rstrip("%"))


def test_runs_on_the_same_images_do_not_narrow_the_interval():
    row = load_script("compare_runs")._row
    rng = np.random.default_rng(1)
    a = rng.uniform(0.2, 0.8, 100)  # per-image CIDEr-D of A and B on one fold
    b = a * rng.uniform(0.8, 1.3, 100)
    figures = [0.0] * 6
    one = _interval(row("0", [(("fold0",), a, b)], np.random.default_rng(0), 4000, figures))
    same = _interval(row("all", [(("fold0",), a, b), (("fold0",), a, b)], np.random.default_rng(0), 4000, figures))
    apart = _interval(row("all", [(("fold0",), a, b), (("fold1",), a, b)], np.random.default_rng(0), 4000, figures))
    assert same == one  # the same images twice: no new evidence, the same interval
    assert apart[1] - apart[0] < 0.8 * (one[1] - one[0])  # two folds of other images: narrower (by ~1/sqrt 2)
