"""CIDEr-D of many captions at once, as the reward of self-critical training.

The same quantity as pycocoevalcap's `Cider` (Vedantam et al. 2015, with the -D changes: clipped
n-gram weights, a Gaussian length penalty with sigma 6, the mean over n = 1..4, x10), computed with
numpy over a whole batch, and with the document frequencies fixed once from a corpus of references
(the training set's) instead of recomputed from each batch. With the corpus set to the scored
images' own references the scores equal pycocoevalcap's, caption for caption (tests pin this).

Captions are token lists (already tokenised, as pycocoevalcap expects). Every n-gram becomes one
integer key: word ids in base 2^16, exact for up to 65,535 distinct words (
COCO has ~30,000; beyond that the keys wrap modulo 2^64, and a collision, astronomically unlikely,
would merge two n-grams).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

N = 4  # n-grams of 1..4 words
SIGMA = 6.0
BASE = np.uint64(1 << 16)


class CiderD:
    """CIDEr-D with document frequencies from `corpus`.

    Args:
        corpus: for each image, its reference captions as token lists.
    """

    def __init__(self, corpus: Sequence[Sequence[Sequence[str]]]) -> None:
        self.ids: dict[str, int] = {}
        encoded = [[self.encode(ref) for ref in refs] for refs in corpus]
        self.log_images = float(np.log(float(len(corpus))))
        self.df_keys: list[np.ndarray] = []  # per n: sorted n-gram keys seen in the corpus
        self.df_log: list[np.ndarray] = []  # per n: log(document frequency) of each key
        image_of = np.repeat(np.arange(len(encoded)), [len(refs) for refs in encoded])
        flat = [ref for refs in encoded for ref in refs]
        for n in range(1, N + 1):
            keys, owner = self._keys(flat, n)
            pairs = np.unique(np.stack([image_of[owner].astype(np.uint64), keys]), axis=1)  # (2, ...) unique per image
            uniq, counts = np.unique(pairs[1], return_counts=True)
            self.df_keys.append(uniq)
            self.df_log.append(np.log(np.maximum(1.0, counts)))

    # --- tokens -> ids -> n-gram keys ---------------------------------------------------------

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        """Token list -> int64 word ids (new words get new ids: they have no document frequency)."""
        return np.array([self.ids.setdefault(t, len(self.ids) + 1) for t in tokens], dtype=np.int64)

    def _keys(self, captions: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Every n-gram of every caption: (keys uint64, index of the caption it comes from)."""
        lengths = np.array([len(c) for c in captions], dtype=np.int64)
        counts = np.maximum(lengths - n + 1, 0)
        if not counts.sum():
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        ids = np.concatenate([c for c in captions if len(c)]).astype(np.uint64) if len(captions) else np.zeros(0)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # where each caption begins in `ids`
        owner = np.repeat(np.arange(len(captions)), counts)  # (G,) caption of each n-gram
        first = starts[owner] + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
        keys = np.zeros(len(owner), dtype=np.uint64)
        for j in range(n):
            keys = keys * BASE + ids[first + j]  # wraps modulo 2^64 only past 65,535 words
        return keys, owner

    def _vectors(self, captions: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """tf-idf vectors of the n-grams: (caption, key, weight) triples with one row per distinct
        n-gram of a caption, and each caption's norm."""
        keys, owner = self._keys(captions, n)
        pairs, tf = np.unique(np.stack([owner.astype(np.uint64), keys]), axis=1, return_counts=True)
        caption, key = pairs[0].astype(np.int64), pairs[1]
        pos = np.searchsorted(self.df_keys[n - 1], key)
        pos = np.minimum(pos, max(len(self.df_keys[n - 1]) - 1, 0))
        known = (self.df_keys[n - 1][pos] == key) if len(self.df_keys[n - 1]) else np.zeros(len(key), bool)
        df_log = np.where(known, self.df_log[n - 1][pos] if len(self.df_log[n - 1]) else 0.0, 0.0)
        weight = tf * (self.log_images - df_log)  # pycocoevalcap's counts2vec
        norm = np.sqrt(np.bincount(caption, weights=weight**2, minlength=len(captions)))
        return caption, key, weight, norm

    # --- scores --------------------------------------------------------------------------------

    def scores(self, hypotheses: Sequence[Sequence[str]], references: Sequence[Sequence[Sequence[str]]]) -> np.ndarray:
        """CIDEr-D of each hypothesis against its own references.

        Args:
            hypotheses: R captions, token lists.
            references: R lists of reference captions (token lists); hypotheses of one image may
                share one list object (it is encoded once).
        Returns:
            (R,) float64 scores.
        """
        hyps = [self.encode(h) for h in hypotheses]
        unique_refs: dict[int, int] = {}  # id(list) -> index of its first caption in `refs`
        refs: list[np.ndarray] = []
        first_ref = np.zeros(len(hyps), dtype=np.int64)
        n_refs = np.zeros(len(hyps), dtype=np.int64)
        for h, ref_list in enumerate(references):
            if id(ref_list) not in unique_refs:
                unique_refs[id(ref_list)] = len(refs)
                refs += [self.encode(r) for r in ref_list]
            first_ref[h], n_refs[h] = unique_refs[id(ref_list)], len(ref_list)
        m_max = int(n_refs.max()) if len(n_refs) else 0
        total = np.zeros((len(hyps), max(m_max, 1)))  # sum over n of each (hypothesis, reference) similarity
        length_h = np.maximum(np.array([len(h) for h in hyps]) - 1, 0)  # pycocoevalcap counts bigrams
        length_r = np.maximum(np.array([len(r) for r in refs]) - 1, 0)
        for n in range(1, N + 1):
            hc, hk, hw, hnorm = self._vectors(hyps, n)
            rc, rk, rw, rnorm = self._vectors(refs, n)
            # Join hypothesis and reference n-grams on (hypothesis, key): each hypothesis n-gram meets the
            # same n-gram in each of its image's references. Keys are made dense for the join.
            _, dense = np.unique(np.concatenate([hk, rk]), return_inverse=True)
            width = int(dense.max()) + 1 if len(dense) else 1
            h_dense, r_dense = dense[: len(hk)], dense[len(hk):]
            ref_sorted = np.argsort(rc * width + r_dense, kind="stable")
            ref_code = (rc * width + r_dense)[ref_sorted]
            num = np.zeros((len(hyps), max(m_max, 1)))
            for slot in range(m_max):  # the slot-th reference of each hypothesis's image
                has = n_refs[hc] > slot
                target = (first_ref[hc] + slot) * width + h_dense
                pos = np.searchsorted(ref_code, target)
                pos = np.minimum(pos, max(len(ref_code) - 1, 0))
                hit = has & (len(ref_code) > 0) & (ref_code[pos] == target) if len(ref_code) else np.zeros_like(has)
                r_idx = ref_sorted[pos[hit]]
                contrib = np.minimum(hw[hit], rw[r_idx]) * rw[r_idx]  # clipped (the -D of CIDEr-D)
                num[:, slot] = np.bincount(hc[hit], weights=contrib, minlength=len(hyps))
            for slot in range(m_max):
                valid = n_refs > slot
                ref = np.where(valid, first_ref + slot, 0)
                denom = hnorm * (rnorm[ref] if len(rnorm) else 0.0)
                sim = np.where((hnorm != 0) & (denom != 0), num[:, slot] / np.where(denom == 0, 1, denom), num[:, slot])
                delta = (length_h - (length_r[ref] if len(length_r) else 0)).astype(np.float64)
                total[:, slot] += np.where(valid, sim * np.exp(-(delta**2) / (2 * SIGMA**2)), 0.0)
        return total.sum(axis=1) / N / np.maximum(n_refs, 1) * 10.0
