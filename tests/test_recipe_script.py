"""scripts/flickr8k.py, the whole Flickr8k recipe: every command it runs is one the CLI accepts, and
the cache stage fills the cache the cross-entropy run reads (the same config and overrides)."""
from __future__ import annotations

import pytest

from captioner.cli import build_parser
from scripts_under_test import load_script


def test_every_training_stage_is_a_command_the_cli_accepts(tmp_path):
    script = load_script("flickr8k")
    args = script.get_args_parser().parse_args(["--data", str(tmp_path / "flickr8k"), "model.encoder.image_size=256"])
    commands = script.training_commands(args, tmp_path / "xent", tmp_path / "scst")
    assert set(commands) == {"cache", "xent", "scst"}
    parser = build_parser()
    for name, command in commands.items():
        try:
            parser.parse_args(command)
        except SystemExit as e:  # argparse's way of refusing
            pytest.fail(f"the {name} stage runs a command the CLI refuses: {' '.join(command)} ({e})")
    cache, xent = parser.parse_args(commands["cache"]), parser.parse_args(commands["xent"])
    assert (cache.config, cache.data, cache.overrides) == (xent.config, xent.data, xent.overrides)
    assert "model.encoder.image_size=256" in xent.overrides
