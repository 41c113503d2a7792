"""Tokenisation and the vocabulary."""
import pytest

from captioner.data.vocab import SPECIALS, Vocabulary, VocabularyError, build_vocabulary, tokenize


def test_tokenize_lowercases_splits_and_drops_punctuation():
    assert tokenize('A Dog\'s "ball", on the grass.') == ["a", "dog", "'s", "ball", "on", "the", "grass"]
    assert tokenize("red circle , blue square !") == ["red", "circle", "blue", "square"]
    assert tokenize("e-mail 3.5 ...") == ["e-mail", "3.5"]


def test_build_vocabulary_orders_by_count_then_alphabet_and_applies_min_count():
    vocab = build_vocabulary(["b a a", "c b a", "d"], min_count=2)
    assert vocab.to_list() == [*SPECIALS, "a", "b"]
    vocab = build_vocabulary(["b a a", "c b a", "d"], min_count=1)
    assert vocab.to_list()[4:] == ["a", "b", "c", "d"]  # c and d tie on 1: alphabetical
    assert build_vocabulary(["a b c", "a d"], max_length=1).to_list()[4:] == ["a"]  # words encode() keeps


def test_specials_have_fixed_ids():
    vocab = build_vocabulary(["a dog"])
    assert (vocab.pad_id, vocab.start_id, vocab.end_id, vocab.unk_id) == (0, 1, 2, 3)
    assert [vocab.word(i) for i in range(4)] == ["<pad>", "<start>", "<end>", "<unk>"]


def test_encode_wraps_cuts_and_maps_unknown_words():
    vocab = build_vocabulary(["a dog runs"])
    ids = vocab.encode("A dog flies.")
    assert ids[0] == vocab.start_id and ids[-1] == vocab.end_id
    assert ids[1:-1] == [vocab.id("a"), vocab.id("dog"), vocab.unk_id]
    assert vocab.encode("a dog runs a dog runs", max_length=2) == [1, vocab.id("a"), vocab.id("dog"), 2]
    assert vocab.encode(["dog", "runs"]) == [1, vocab.id("dog"), vocab.id("runs"), 2]


def test_decode_stops_at_end_and_skips_specials():
    vocab = build_vocabulary(["a dog runs"])
    ids = [1, vocab.id("a"), 3, vocab.id("dog"), 2, vocab.id("runs"), 0, 0]
    assert vocab.decode(ids) == ["a", "dog"]
    assert vocab.decode(ids, keep_unk=True) == ["a", "<unk>", "dog"]
    assert vocab.decode(vocab.encode("a dog runs")) == ["a", "dog", "runs"]


def test_round_trip_through_list_and_file(tmp_path):
    vocab = build_vocabulary(["a red circle", "a blue square above a red circle"])
    assert Vocabulary.from_list(vocab.to_list()) == vocab
    path = vocab.save(tmp_path / "vocab.json")
    again = Vocabulary.load(path)
    assert again == vocab and len(again) == len(vocab)
    assert again.encode("a red circle") == vocab.encode("a red circle")


def test_bad_vocabularies_are_refused(tmp_path):
    with pytest.raises(VocabularyError, match="must start with"):
        Vocabulary.from_list(["a", "b"])
    with pytest.raises(VocabularyError, match="duplicate"):
        Vocabulary.from_list([*SPECIALS, "a", "a"])
    bad = tmp_path / "v.json"
    bad.write_text("{not json")
    with pytest.raises(VocabularyError, match="v.json"):
        Vocabulary.load(bad)
