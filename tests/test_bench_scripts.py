"""The benchmark scripts run end to end on a tiny set (their numbers are not checked: they time this
machine). A script nothing runs breaks silently: bench_train.py crashed on a config it was written for,
and its --amp row on any config with a word detector."""
from scripts_under_test import load_script


def test_bench_train_prints_every_row_on_a_tiny_set(capsys, tmp_path):
    bench = load_script("bench_train")
    assert bench.main(["--config", "shapes", "--data", "shapes", "--limit-images", "12",
                       "--cache-dir", str(tmp_path), "data.shapes_images=20", "model.encoder.name=random",
                       "model.encoder.image_size=64", "--amp"]) == 0
    out = capsys.readouterr().out
    for row in ("(a) cached, grouped by image", "(a) cached, plain caption order", "(a) grouped, similar lengths",
                "(a) detector scoring all words", "(b) encoder on every caption", "speed-up (a)/(b)", "peak RSS",
                "cached steps, float32"):
        assert row in out, row
