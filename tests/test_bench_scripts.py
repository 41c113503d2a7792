"""The benchmark scripts run end to end on a tiny set (their numbers are not checked: they time this
machine). A script nothing runs breaks silently: bench_train.py crashed on a config it was written for,
and its old float32/bf16 row on any config with a word detector."""
from scripts_under_test import load_script

TINY = ["data.shapes_images=20", "model.encoder.name=random", "model.encoder.image_size=64"]


def test_bench_train_prints_every_row_on_a_tiny_set(capsys, tmp_path):
    bench = load_script("bench_train")
    assert bench.main(["--config", "shapes", "--data", "shapes", "--limit-images", "12",
                       "--cache-dir", str(tmp_path), *TINY]) == 0
    out = capsys.readouterr().out
    for row in ("(a) cached, grouped by image", "(a) cached, plain caption order", "(a) grouped, similar lengths",
                "(a) detector scoring all words", "(b) encoder on every caption", "speed-up (a)/(b)", "peak RSS"):
        assert row in out, row


def test_bench_amp_times_whole_runs_in_each_precision(capsys):
    bench = load_script("bench_amp")
    assert bench.main(["--config", "shapes", "--data", "shapes", "--steps", "2", *TINY]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:3]] == ["float32", "bf16"]  # one run of each, in that order
    assert all(float(line.split()[-1]) > 0 for line in lines[1:3])  # a peak RSS was read for each process
    assert lines[-1].startswith("bf16 autocast / float32:")


def test_bench_step_times_the_shared_channels_each_way(capsys):
    bench = load_script("bench_step")
    assert bench.main(["--config", "shapes", "--data", "shapes", "--images", "12", "--steps", "2", "--repeats", "1",
                       *TINY, "model.encoder.two_scale=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line[:32].strip() for line in lines[2:]] == ["the step as shipped", "shared channels in every cell"]
    assert float(lines[2].split()[-2]) == 1.0  # the shipped step over itself
