"""Tokenisation and the word <-> id vocabulary.

A caption is encoded as `[<start>, w1, ..., wn, <end>]` (ids); `<pad>` is always id 0 so padded
batches can be masked with `tokens != 0`.
"""
from __future__ import annotations

import functools
import json
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from captioner.errors import CaptionerError
from captioner.files import atomic_write_text

if TYPE_CHECKING:
    from nltk.tokenize import TreebankWordTokenizer

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS: tuple[str, ...] = (PAD, START, END, UNK)

# Words a caption should not end on: "a man riding a" is what a model breaks into when it games
# CIDEr (self-critical training). Decoding never ends right after one (`decode.no_dangling`), and
# evaluation counts the captions that do (`captioner.decoding.metrics.diversity`).
FUNCTION_WORDS = frozenset("""
    a an the this that these those some of in on at to into onto with without from by for near under over above
    below behind beside between through across around up down and or but while as is are was were be being his
    her their its my your our""".split())


class VocabularyError(CaptionerError):
    """A vocabulary list or file that cannot be used (one-line message)."""


@functools.lru_cache(maxsize=1)
def _tokenizer() -> TreebankWordTokenizer:
    from nltk.tokenize import TreebankWordTokenizer  # here, not at the top: captioning never tokenizes

    return TreebankWordTokenizer()  # rule based: needs no downloaded nltk data


def _is_punctuation(token: str) -> bool:
    return all(c in string.punctuation or unicodedata.category(c).startswith("P") for c in token)


def tokenize(text: str) -> list[str]:
    """Lower-case PTB-style tokens with pure-punctuation tokens dropped.

    >>> tokenize("A dog's ball, on the grass.")
    ['a', 'dog', "'s", 'ball', 'on', 'the', 'grass']
    """
    return [t for t in _tokenizer().tokenize(text.lower()) if not _is_punctuation(t)]


class Vocabulary:
    """Words in id order; ids 0-3 are `<pad> <start> <end> <unk>`."""

    def __init__(self, words: Sequence[str]) -> None:
        """`words`: the full id-ordered list, specials first (see `from_list`, `build_vocabulary`)."""
        words = list(words)
        if tuple(words[: len(SPECIALS)]) != SPECIALS:
            raise VocabularyError(f"vocabulary must start with {' '.join(SPECIALS)}, got {words[:4]}")
        seen: set[str] = set()
        for i, w in enumerate(words):
            if not isinstance(w, str) or not w:
                raise VocabularyError(f"vocabulary entry {i}: expected a non-empty string, got {w!r}")
            if w in seen:
                raise VocabularyError(f"vocabulary entry {i}: duplicate word {w!r}")
            seen.add(w)
        self._itos = words
        self._stoi = {w: i for i, w in enumerate(words)}

    # --- ids ---------------------------------------------------------------------------------
    pad_id = 0
    start_id = 1
    end_id = 2
    unk_id = 3

    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, word: object) -> bool:
        return word in self._stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self._itos == other._itos

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} words)"

    def id(self, word: str) -> int:
        """The id of `word`, or `unk_id`."""
        return self._stoi.get(word, self.unk_id)

    def word(self, idx: int) -> str:
        """The word with id `idx`."""
        return self._itos[idx]

    def function_ids(self) -> list[int]:
        """The ids of the `FUNCTION_WORDS` this vocabulary holds (a caption never ends on one)."""
        return [self.id(w) for w in sorted(FUNCTION_WORDS) if w in self]

    def content_ids(self) -> list[int]:
        """The ids of the content words: neither a special nor one of the `FUNCTION_WORDS`."""
        return [i for i, w in enumerate(self._itos) if i >= len(SPECIALS) and w not in FUNCTION_WORDS]

    # --- captions ----------------------------------------------------------------------------
    def encode(self, text_or_tokens: str | Sequence[str], max_length: int | None = None) -> list[int]:
        """`[<start>, w1..wn, <end>]` with n <= max_length words (longer captions are cut)."""
        tokens = tokenize(text_or_tokens) if isinstance(text_or_tokens, str) else list(text_or_tokens)
        if max_length is not None:
            tokens = tokens[:max_length]
        return [self.start_id, *(self.id(t) for t in tokens), self.end_id]

    def decode(self, ids: Iterable[int], keep_unk: bool = False) -> list[str]:
        """Words of `ids` up to the first `<end>`; `<pad>`/`<start>` (and `<unk>` unless `keep_unk`) skipped.

        Accepts a list of ints or a 1-D tensor / array.
        """
        words = []
        for i in ids:
            i = int(i)
            if i == self.end_id:
                break
            if i in (self.pad_id, self.start_id) or (i == self.unk_id and not keep_unk):
                continue
            words.append(self._itos[i])
        return words

    # --- persistence -------------------------------------------------------------------------
    def to_list(self) -> list[str]:
        """All words in id order (specials first); what checkpoints store."""
        return list(self._itos)

    @classmethod
    def from_list(cls, words: Sequence[str]) -> Vocabulary:
        """Inverse of `to_list`; raises VocabularyError when the list is not a vocabulary."""
        if not isinstance(words, (list, tuple)):
            raise VocabularyError(f"vocabulary must be a list of words, got {type(words).__name__}")
        return cls(words)

    def save(self, path: str | Path) -> Path:
        """Write the id-ordered word list as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, json.dumps(self._itos, ensure_ascii=False, indent=0) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Read a vocabulary written by `save`."""
        path = Path(path)
        try:
            words = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise VocabularyError(f"{path}: vocabulary file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise VocabularyError(f"{path}: not a JSON vocabulary ({e})") from None
        try:
            return cls.from_list(words)
        except VocabularyError as e:
            raise VocabularyError(f"{path}: {e}") from None


def build_vocabulary(captions: Iterable[str | Sequence[str]], min_count: int = 1,
                     max_length: int | None = None) -> Vocabulary:
    """Words seen at least `min_count` times, ordered by count (descending) then alphabetically.

    `captions` are raw strings (tokenised here) or token lists. With `max_length`, only the words
    `encode` keeps (the first max_length of each caption) are counted.
    """
    counts: Counter[str] = Counter()
    for c in captions:
        counts.update((tokenize(c) if isinstance(c, str) else list(c))[:max_length])
    for s in SPECIALS:
        counts.pop(s, None)
    words = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
    return Vocabulary([*SPECIALS, *words])
