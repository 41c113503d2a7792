"""A caption a user gives (`caption(text=)`, `--text`) as word ids, without torch: what teacher forcing
reads in both runtimes (`decoding.forced` in torch, `decoding.numpy_search.force_text` in numpy)."""
from __future__ import annotations

from captioner.data.vocab import SPECIALS, Vocabulary, tokenize
from captioner.errors import CaptionerError


class TextError(CaptionerError):
    """A caption to force that the model cannot read: no words, or words outside its vocabulary."""


def text_ids(text: str, vocab: Vocabulary) -> list[int]:
    """The word ids of `text`, tokenised as training captions are (`tokenize`), without <start>/<end>.

    Raises TextError when no word is left, or naming every word the vocabulary lacks: such a word is
    never read as <unk>, whose map would say nothing about the word asked for.
    """
    words = tokenize(text)
    if not words:
        raise TextError(f"text {text.strip()[:60]!r}: no words to caption with")
    unknown = list(dict.fromkeys(w for w in words if w not in vocab or w in SPECIALS))  # in order, once each
    if unknown:
        raise TextError(f"text: {', '.join(repr(w) for w in unknown)} not in the model's vocabulary "
                        f"({len(vocab) - len(SPECIALS):,} words)")
    return [vocab.id(w) for w in words]
