"""scripts/flickr8k.py, the whole Flickr8k recipe: every command it runs is one the CLI accepts, and
the cache stage fills the cache the cross-entropy run reads (the same config and overrides)."""
from __future__ import annotations

import pytest

from captioner.cli import build_parser
from scripts_under_test import load_script


def test_each_model_is_scored_with_its_own_configs_decoding(tmp_path):
    """The SCST model with the SCST config's beam (8), the cross-entropy one with its config's (5)."""
    script = load_script("flickr8k")
    parser = build_parser()
    scored = {}
    for name, flags in script.stage_decodings(script.get_args_parser().parse_args([]), tmp_path / "xent").items():
        scored[name] = parser.parse_args(["evaluate", "--checkpoint", "best.pt", *flags]).beam_size
    assert scored == {"cross-entropy": 5, "SCST": 8}
    only_xent = script.stage_decodings(script.get_args_parser().parse_args(["--scst-config", ""]), tmp_path / "xent")
    assert only_xent["SCST"] == only_xent["cross-entropy"]


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


def test_the_model_card_states_the_scores_and_the_decoding_rules(tmp_path):
    script = load_script("flickr8k")
    args = script.get_args_parser().parse_args(["--data", str(tmp_path), "--scst-config", "", "train.seed=0"])
    row = {"beam": 5, "Bleu_1": 0.63, "Bleu_4": 0.218, "METEOR": 0.207, "ROUGE_L": 0.465, "CIDEr": 0.526, "words": 234,
           "chair_i": 0.0312, "chair_s": 0.0412, "hit": 0.89, "centre": 0.712, "mass": 0.707, "even": 0.294}
    manifest = {"encoder": {"name": "efficientnet_lite0", "image_size": 384, "grid": [12, 12], "precision": "float32",
                            "encoder_weights": "float16", "relative_difference": 0.0026,
                            "decoder_weights": "int8"},
                "decode": {"beam_size": 5, "no_repeat_ngram": 2, "no_repeat_words": True}}
    script.write_card(tmp_path / "MODEL_CARD.md", "cross-entropy", {"cross-entropy": row}, {"xent": 30.0}, args,
                      manifest)
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "12x12 grid" in card and "research use" in card
    assert "`python scripts/flickr8k.py --data PATH/flickr8k --bundle DIR train.seed=0`" in card  # how to rebuild it
    assert "the encoder's weights in float16 (computed in float32; its grids within 0.3% of the trained" in card
    assert "the decoder's weight matrices in int8 (one float32 scale per row" in card
    assert ("| cross-entropy | 5 | 0.630 | 0.218 | 0.207 | 0.465 | 0.526 | 234 | 3.1% / 4.1% | 0.890 (0.712) "
            "| 0.707 (0.294) |") in card
    assert "(970 photos, each model with its config's beam, no repeated 2-gram, no content word twice;" in card


def test_the_int8_encoder_is_calibrated_on_training_photos_alone(tmp_path):
    """The bundle's int8 ranges come from 64 training photos spread over the train list: never a dev or
    test photo (the test list is what the project is scored on)."""
    import PIL.Image

    script = load_script("flickr8k")
    names = [f"{i}.jpg" for i in range(200)]
    (tmp_path / "Images").mkdir()
    for name in names:
        PIL.Image.new("RGB", (8, 8)).save(tmp_path / "Images" / name)
    (tmp_path / "Flickr8k.token.txt").write_text("".join(f"{n}#0\ta dog runs .\n" for n in names))
    (tmp_path / "Flickr_8k.trainImages.txt").write_text("\n".join(names[:150]) + "\n")
    (tmp_path / "Flickr_8k.devImages.txt").write_text("\n".join(names[150:180]) + "\n")
    (tmp_path / "Flickr_8k.testImages.txt").write_text("\n".join(names[180:]) + "\n")
    photos = script.calibration_photos(tmp_path)
    assert len(photos) == len(set(photos)) == 64
    assert {p.rsplit("/", 1)[1] for p in photos} <= set(names[:150])
    assert photos[0].endswith("/0.jpg") and photos[-1].endswith("/126.jpg")  # spread over the list, not its head
    decoding = ["--beam", "5", "--no-repeat-words"]
    export = build_parser().parse_args(script.bundle_command(tmp_path / "best.pt", tmp_path / "bundle", decoding, photos))
    assert (export.quantize, export.small, export.calibration, export.beam_size) == ("int8", "int8", photos, 5)
