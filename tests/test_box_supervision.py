"""Attention supervision from object boxes (`train.box_weight`, `training/boxes.py`): the cells a
word should look at, the loss that pulls its map there, and a run that trains with it."""
import json

import numpy as np
import pytest
import torch

from captioner.cli import main
from captioner.config import ConfigError, parse_config
from captioner.data.boxes import GroundObject
from captioner.data.vocab import build_vocabulary
from captioner.model.decoder import DecoderOutput
from captioner.model.grid import Cells
from captioner.recipes.train import run_config, train
from captioner.training.boxes import BoxTargets, box_attention, object_cells
from captioner.training.loss import caption_loss

NOMINAL = Cells(0.125, 0.25)  # a 4x4 grid's cells centred at (j + 0.5) / 4 of the side
DOG = GroundObject(("dog", "dogs"), ((0.0, 0.0, 200.0, 100.0),))  # the top-left quarter of a 400x200 photo
BALL = GroundObject(("ball",), ((390.0, 190.0, 398.0, 198.0),))  # smaller than a cell, bottom-right


def test_an_objects_cells_are_those_whose_centres_lie_in_its_boxes():
    cells = object_cells(DOG, (400, 200), (4, 4), NOMINAL).reshape(4, 4)
    assert cells[:2, :2].all() and cells.sum() == 4


def test_a_box_smaller_than_a_cell_gets_the_cell_nearest_its_middle():
    cells = object_cells(BALL, (400, 200), (4, 4), NOMINAL).reshape(4, 4)
    assert cells[3, 3] and cells.sum() == 1


def _targets(captions):
    vocab = build_vocabulary(captions)
    objects = [[(o, object_cells(o, (400, 200), (4, 4), NOMINAL)) for o in (DOG, BALL)], []]
    return vocab, BoxTargets(objects, vocab, 16)


def test_each_word_naming_a_boxed_object_gets_its_cells_and_no_other_word_any():
    captions = ["a dog chases a ball", "two dogs play"]
    vocab, targets = _targets(captions)
    tokens = torch.tensor([vocab.encode(captions[0]), vocab.encode(captions[1]) + [0, 0]])  # (2, 7)
    cells = targets.cells(tokens, torch.tensor([0, 1]))  # (2, 6, 16): photo 1 has no boxes
    assert cells.shape == (2, 6, 16)
    named = cells.any(-1)
    assert named[0].tolist() == [False, True, False, False, True, False]  # "dog" at step 1, "ball" at 4
    assert not named[1].any()
    assert torch.equal(cells[0, 1], torch.from_numpy(object_cells(DOG, (400, 200), (4, 4), NOMINAL)))
    # the same caption on the boxed photo: "dogs" names the dog too
    assert targets.cells(tokens[1:], torch.tensor([0]))[0].any(-1).tolist() == [False, True, False, False, False, False]


def _out(alphas, steps):
    P = len(steps)
    return DecoderOutput(torch.zeros(P, 5), alphas, torch.zeros(P, dtype=torch.long), torch.tensor(steps))


def test_box_loss_is_minus_log_the_maps_mass_on_the_cells_of_the_words_that_name_one():
    cells = torch.zeros(1, 3, 4, dtype=torch.bool)
    cells[0, 1, :2] = True  # only step 1's word names an object, in cells 0 and 1
    alphas = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.3, 0.1, 0.2, 0.4], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(box_attention(_out(alphas, [0, 1, 2]), cells), -torch.log(torch.tensor(0.4)))
    assert box_attention(_out(alphas[[0, 2]], [0, 2]), cells).item() == 0.0  # no word of these names one


def test_the_box_term_joins_the_loss_at_its_weight_and_pulls_the_map_into_the_box():
    alphas = torch.full((3, 4), 0.25, requires_grad=True)
    out = _out(alphas, [0, 1, 2])
    tokens = torch.zeros(1, 4, dtype=torch.long)
    cells = torch.zeros(1, 3, 4, dtype=torch.bool)
    cells[0, 1, 0] = True
    plain = caption_loss(out, tokens)
    boxed = caption_loss(out, tokens, box_cells=cells, box_weight=2.0)
    torch.testing.assert_close(boxed.box, torch.log(torch.tensor(4.0)))
    torch.testing.assert_close(boxed.total, plain.total + 2.0 * boxed.box)
    (grad,) = torch.autograd.grad(boxed.total, alphas)
    assert grad[1, 0] < 0 and not grad[[0, 2]].any()  # more weight in the box lowers the loss
    assert caption_loss(out, tokens, box_cells=cells).box.item() == 0.0  # weight 0: not computed


def test_box_weight_with_self_critical_training_is_refused():
    with pytest.raises(ConfigError, match="train.box_weight"):
        parse_config({"train": {"box_weight": 1.0, "objective": "scst", "init": "x.pt"}})


TINY = """\
data: {path: shapes, shapes_images: 40}
model:
  encoder: {name: random, image_size: 64}
  decoder: {embed_dim: 16, hidden_dim: 32, attention_dim: 16, dropout: 0.0}
train: {epochs: 4, batch_size: 16, lr: 0.005, patience: 0, amp: "off", coverage_weight: 0, box_weight: 1.0}
decode: {beam_size: 1, max_length: 12}
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch, single_process):
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_a_run_on_the_shapes_boxes_logs_the_box_term_and_lowers_it(tiny, tmp_path):
    """The built-in shapes carry their boxes: box supervision needs no file there."""
    train(run_config(tiny, []), tmp_path / "run", "cpu")
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    box = [ln["box"] for ln in lines if "box" in ln]
    assert len(box) >= 3 and all(np.isfinite(box))
    assert box[-1] < 0.8 * box[0]


def test_a_box_file_naming_no_training_photo_stops_before_any_work(tiny, tmp_path, capsys):
    boxes = tmp_path / "boxes.jsonl"
    boxes.write_text(json.dumps({"image": "elsewhere.jpg", "objects": [{"words": ["dog"], "boxes": [[0, 0, 5, 5]]}]}))
    assert main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), f"data.boxes={boxes}"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.box_weight" in err and "names none of the" in err
    assert not (tmp_path / "cache" / "features").exists() and not (tmp_path / "run" / "last.pt").exists()
