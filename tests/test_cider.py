"""CIDEr-D as the self-critical reward: the same numbers as pycocoevalcap, computed in one pass."""
import random

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider

from captioner.decoding.cider import CiderD

WORDS = ["a", "the", "dog", "cat", "man", "woman", "red", "blue", "runs", "sits", "on", "in", "grass", "water", "ball", "with", "two", "is"]


def _corpus(seed: int, images: int = 40):
    rng = random.Random(seed)
    caption = lambda: [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
    refs = [[caption() for _ in range(rng.randint(1, 5))] for _ in range(images)]
    hyps = [caption() for _ in range(images)]
    hyps[3] = list(refs[3][0])  # one exact match
    hyps[5] = ["zebra", "zebra"]  # words no reference has
    return refs, hyps


@pytest.mark.parametrize("seed", [0, 1])
def test_scores_equal_pycocoevalcap_caption_for_caption(seed):
    refs, hyps = _corpus(seed)
    gts = {i: [" ".join(r) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [" ".join(h)] for i, h in enumerate(hyps)}
    mean, expected = Cider().compute_score(gts, res)
    got = CiderD(refs).scores(hyps, refs)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert got.mean() == pytest.approx(mean) and got[5] == 0.0 and got[3] > 1.0


def test_document_frequencies_come_from_the_corpus_not_the_batch():
    refs, hyps = _corpus(2)
    cider = CiderD(refs)  # the training references, once
    batch = list(range(0, 40, 7))
    together = cider.scores([hyps[i] for i in batch], [refs[i] for i in batch])
    alone = [cider.scores([hyps[i]], [refs[i]])[0] for i in batch]
    np.testing.assert_allclose(together, alone)  # a caption's reward does not depend on its batch
    gts = {i: [" ".join(r) for r in refs[i]] for i in batch}
    _, batch_df = Cider().compute_score(gts, {i: [" ".join(hyps[i])] for i in batch})
    assert not np.allclose(together, batch_df)  # pycocoevalcap on the batch alone would use its df


def test_samples_of_one_image_share_its_references():
    refs, _ = _corpus(3)
    cider = CiderD(refs)
    samples = [refs[0][0], ["a", "dog"], [], ["the", "the", "the"]]
    scores = cider.scores(samples, [refs[0]] * 4)
    assert scores.shape == (4,) and scores[0] == scores.max() and scores[2] == 0.0
