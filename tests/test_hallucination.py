"""Object hallucination (CHAIR): which caption words name a kind of thing, and which of those no
reference of the photo names."""
from __future__ import annotations

import numpy as np
import pytest

from captioner.config import DecodeConfig
from captioner.data.records import Record
from captioner.decoding.caption import Caption
from captioner.decoding.evaluation import evaluate_records
from captioner.decoding.hallucination import (
    COCO_CATEGORIES,
    OBJECT_WORDS,
    hallucinated_words,
    hallucination,
    object_mentions,
    reference_hallucination,
)


def test_every_coco_kind_has_a_caption_word_and_every_word_names_coco_kinds():
    named = {kind for kinds in OBJECT_WORDS.values() for kind in kinds}
    assert len(COCO_CATEGORIES) == 80 and named == set(COCO_CATEGORIES)


@pytest.mark.parametrize(("text", "mentions"), [
    ("A man throws a tennis ball to his dog.", ["man", "tennis ball", "dog"]),
    ("a boy eats a hot dog", ["boy", "hot dog"]),  # a phrase before its words: food, not an animal
    ("a girl holds her teddy bear", ["girl", "teddy bear"]),
    ("a man and a boy and two girls", ["man"]),  # one kind, one mention
    ("a dog in a light blue collar runs past an orange cone", ["dog"]),  # colours, not lights or oranges
    ("a man in glasses and a baseball cap", ["man"]),  # worn things, not a wine glass or a ball
    ("Two puppies", ["puppies"]),
    ("grass and water", []),
])
def test_object_mentions_read_the_kinds_a_caption_names(text, mentions):
    assert list(object_mentions(text)) == mentions


def test_a_synonym_of_a_referenced_kind_is_not_hallucinated_and_another_kind_is():
    refs = ["A puppy runs on the grass .", "A small brown dog is running ."]
    assert hallucinated_words("a dog plays with a ball", refs) == ["ball"]
    assert hallucinated_words("a brown dog runs on the grass", refs) == []
    assert hallucinated_words("a cat and a frisbee", refs) == ["cat", "frisbee"]


def test_a_word_of_two_kinds_counts_when_the_references_name_either():
    assert hallucinated_words("a man rides a bike", ["A man on a motorcycle ."]) == []
    assert hallucinated_words("a man rides a bike", ["A man on a horse ."]) == ["bike"]
    # A rider names the thing ridden too: a surfer's photo holds a surfboard.
    assert hallucinated_words("a man on a surfboard", ["A surfer rides a wave ."]) == []


def test_chair_counts_mentions_and_captions():
    references = {
        "a.jpg": ["A dog catches a ball .", "A brown dog jumps ."],
        "b.jpg": ["A woman sits on a bench .", "A lady on a bench ."],
        "c.jpg": ["A snowy mountain ."],
    }
    captions = {"a.jpg": "a dog catches a frisbee",  # dog right, frisbee wrong
                "b.jpg": "a woman sits on a bench",  # both right
                "c.jpg": "a man and a dog on a mountain"}  # both wrong
    h = hallucination(references, captions)
    assert (h.captions, h.mentions, h.hallucinated, h.captions_hallucinating) == (3, 6, 3, 2)
    assert h.chair_i == pytest.approx(3 / 6) and h.chair_s == pytest.approx(2 / 3)
    assert h.by_word == {"frisbee": 1, "man": 1, "dog": 1}
    assert h.to_json()["chair_s"] == pytest.approx(2 / 3)


def test_no_object_word_gives_zero_rates_not_a_division_error():
    h = hallucination({"a": ["a red circle"]}, {"a": "a red circle"})
    assert (h.mentions, h.chair_i, h.chair_s) == (0, 0.0, 0.0)


def test_each_reference_is_scored_against_the_others_of_its_photo():
    references = {
        "a.jpg": ["A dog on the grass .", "A dog runs .", "A dog chases a cat ."],  # only one names a cat
        "b.jpg": ["A horse ."],  # one reference: nothing to hold it against
    }
    h = reference_hallucination(references)
    assert (h.captions, h.mentions, h.hallucinated) == (3, 4, 1) and h.by_word == {"cat": 1}


class _Writes:
    """A captioner that writes the given caption for each image (all `evaluate_records` asks of one)."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def caption_files(self, paths, batch_size, **decode):
        for path in paths:
            words = self.texts[path].split()
            yield path, Caption(self.texts[path], words, 0.0, 0.0, np.full((len(words), 2, 2), 0.25, np.float32),
                                (8, 8), path)

    def decode_config(self, **decode):
        return DecodeConfig(**decode)


def test_an_evaluation_reports_chair_beside_the_references_and_each_captions_hallucinated_words(tmp_path):
    records = [Record(tmp_path / "a.jpg", ("A dog catches a ball .", "A brown dog jumps ."), "test"),
               Record(tmp_path / "b.jpg", ("A woman on a bench .", "A lady sits on a bench ."), "test")]
    captioner = _Writes({str(tmp_path / "a.jpg"): "a dog catches a frisbee",
                         str(tmp_path / "b.jpg"): "a woman sits on a bench"})
    result = evaluate_records(captioner, records, meteor=False)
    assert (result.hallucination.mentions, result.hallucination.hallucinated) == (4, 1)
    assert result.reference_hallucination.captions == 4 and result.reference_hallucination.hallucinated == 1  # "ball"
    report = result.to_json()
    assert report["hallucination"]["generated"]["by_word"] == {"frisbee": 1}
    assert [c["hallucinated"] for c in report["captions"]] == [["frisbee"], []]
