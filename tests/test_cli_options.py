"""Bad values on the command line: one line naming the option or argument, exit status 2, before any
model loads (the decode options every captioning command shares, empty paths, a closed stdout)."""
import sys

import PIL.Image
import pytest

from captioner.cli import caption, common, evaluate, main, serve, visualize

COMMANDS = {"caption": ["caption", "photo.jpg"], "visualize": ["visualize", "photo.jpg", "-o", "out.png"],
            "evaluate": ["evaluate", "--checkpoint", "model.pt"], "serve": ["serve"]}


@pytest.fixture(autouse=True)
def no_model(monkeypatch, tmp_path):
    """Run in an empty folder, and fail any test that gets as far as loading a model."""

    def load_captioner(*args, **kwargs):
        raise AssertionError("the model loaded: the bad value was not refused first")

    for module in (caption, evaluate, serve, visualize):
        monkeypatch.setattr(module, "load_captioner", load_captioner)
    monkeypatch.chdir(tmp_path)


def refused(argv: list[str], capsys) -> str:
    """The one line of stderr that `captioner argv` refuses with, after checking exit status 2."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("flag, value, shown", [
    ("--beam", "101", "101 is not allowed (must be [1, 100])"),  # --beam 5000 took 4.5 GB
    ("--beam", "99999999999999999999", "99999999999999999999 is not allowed (must be [1, 100])"),  # OverflowError
    ("--length-penalty", "300", "300.0 is not allowed (must be [0, 10])"),  # OverflowError in length**300
    ("--length-penalty", "inf", "inf is not allowed (must be [0, 10])"),
    ("--length-penalty", "nan", "nan is not allowed (must be [0, 10])"),
])
def test_decode_options_out_of_range_are_one_line_in_every_command(command, flag, value, shown, capsys):
    assert refused([*COMMANDS[command], flag, value], capsys) == f"captioner: error: {flag}: {shown}"


@pytest.mark.parametrize("command", ["caption", "visualize"])
def test_the_bounds_are_in_the_help(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "1 = greedy, [1, 100]" in help_text and "EXPONENT [0, 10]" in help_text


@pytest.mark.parametrize("argv, named", [
    (["caption", ""], "IMG"),
    (["caption", "photo.jpg", ""], "IMG"),
    (["visualize", "", "-o", "out.png"], "IMG"),
    (["visualize", "photo.jpg", "-o", ""], "--out"),
    (["visualize", "photo.jpg", "-o", "out.png", "--gif", ""], "--gif"),
])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(argv, named, tmp_path, capsys):
    for name in ("photo.jpg", "other.jpg"):  # what an empty path would otherwise have reached
        PIL.Image.new("RGB", (32, 32), "red").save(tmp_path / name)
    assert refused(argv, capsys) == f"captioner: error: {named}: empty path (an unset shell variable?)"


def test_an_empty_checkpoint_path_is_refused(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(caption, "load_captioner", common.load_captioner)  # the real one: it checks the paths
    PIL.Image.new("RGB", (32, 32), "red").save(tmp_path / "photo.jpg")
    assert refused(["caption", "photo.jpg", "--checkpoint", ""], capsys) == \
        "captioner: error: --checkpoint: empty path (an unset shell variable?)"


def test_caption_with_stdout_closed_fails(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of a closed stdout (`captioner caption x >&-`)
    assert refused(["caption", "photo.jpg"], capsys) == \
        "captioner: error: standard output is closed: nowhere to print the captions"
