import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from captioner.model.decoder import DecoderOutput
from captioner.training.loss import caption_loss


def _packed(lengths: list[int], V: int, L: int, alphas=None) -> tuple[DecoderOutput, torch.Tensor, torch.Tensor]:
    """A packed output for captions of `lengths` scored positions, with random logits; returns it,
    the (B, T + 1) tokens and the padded (B, T, V) logits."""
    B, T = len(lengths), max(lengths)
    tokens = torch.randint(0, V, (B, T + 1))
    caption = torch.tensor([b for t in range(T) for b in range(B) if lengths[b] > t])
    step = torch.tensor([t for t in range(T) for b in range(B) if lengths[b] > t])
    padded = torch.randn(B, T, V)
    if alphas is None:
        alphas = torch.full((len(caption), L), 1.0 / L)
    return DecoderOutput(padded[caption, step], alphas, caption, step), tokens, padded


def test_cross_entropy_is_over_the_real_tokens_only():
    out, tokens, padded = _packed([5, 2], V=7, L=4)
    loss = caption_loss(out, tokens)
    expected = F.cross_entropy(torch.cat([padded[0], padded[1, :2]]), torch.cat([tokens[0, 1:], tokens[1, 1:3]]))
    torch.testing.assert_close(loss.xent, expected)
    torch.testing.assert_close(loss.total, expected)


def test_coverage_term_is_the_mean_over_regions():
    L = 4
    # Each region looked at exactly once over the 4 steps: no penalty.
    out, tokens, _ = _packed([4], V=5, L=L, alphas=torch.eye(L))
    assert caption_loss(out, tokens, coverage_weight=1.0).coverage.item() == 0.0
    # Always region 0: coverage (4, 0, 0, 0) -> ((1-4)^2 + 3 * 1) / 4 regions = 3.
    stuck = torch.zeros(4, L)
    stuck[:, 0] = 1
    out, tokens, _ = _packed([4], V=5, L=L, alphas=stuck)
    loss = caption_loss(out, tokens, coverage_weight=0.5)
    assert loss.coverage.item() == 3.0
    torch.testing.assert_close(loss.total, loss.xent + 1.5)


def test_coverage_is_per_caption_then_averaged():
    """Two captions, each attending to its own region at every step: caption 0 (3 steps) covers
    region 0 three times, caption 1 (1 step) region 1 once."""
    alphas = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0], [1.0, 0, 0]])  # time-major: c0 c1 c0 c0
    out, tokens, _ = _packed([3, 1], V=5, L=3, alphas=alphas)
    # caption 0: (1-3)^2 + 1 + 1 = 6; caption 1: 1 + 0 + 1 = 2; over 2 captions x 3 regions: 8 / 6
    assert caption_loss(out, tokens, coverage_weight=1.0).coverage.item() == pytest.approx(8 / 6)


def test_coverage_does_not_grow_with_the_grid():
    """The same looks on a 4- and on a 16-region grid (the extra regions never looked at, like the
    corners of a finer grid): the summed term of older versions grew 4x, the mean stays put."""
    small = torch.full((4, 4), 0.25)  # 4 steps spread evenly: each region covered exactly once
    large = torch.zeros(16, 16)
    large[:, :4] = 0.25  # 16 steps over the first 4 regions: each covered 4 times, 12 never
    a = caption_loss(_packed([4], V=5, L=4, alphas=small)[0], torch.zeros(1, 5, dtype=torch.long), coverage_weight=1.0)
    b = caption_loss(_packed([16], V=5, L=16, alphas=large)[0], torch.zeros(1, 17, dtype=torch.long),
                     coverage_weight=1.0)
    assert a.coverage.item() == 0.0
    assert b.coverage.item() == pytest.approx((4 * 9 + 12 * 1) / 16)  # 3.0, not the sum 48


def test_a_term_whose_weight_is_zero_is_not_computed(monkeypatch):
    out, tokens, _ = _packed([3, 2], V=5, L=4)
    calls = []
    real_log = torch.Tensor.log
    monkeypatch.setattr(torch.Tensor, "log", lambda self: calls.append("log") or real_log(self))
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda *a, **k: calls.append("index_add_"))
    loss = caption_loss(out, tokens)
    assert calls == [] and loss.coverage.item() == 0.0 and loss.entropy.item() == 0.0
    torch.testing.assert_close(loss.total, loss.xent)


def test_entropy_penalty_is_the_mean_entropy_of_the_maps():
    L = 4
    out, tokens, _ = _packed([3], V=5, L=L)  # every map 1/L everywhere: entropy ln L
    loss = caption_loss(out, tokens, entropy_weight=0.5)
    torch.testing.assert_close(loss.entropy, torch.tensor(math.log(L)))
    torch.testing.assert_close(loss.total, loss.xent + 0.5 * math.log(L))
    assert caption_loss(out, tokens).total == loss.xent  # off by default


def test_entropy_of_maps_with_exact_zeros_has_a_finite_gradient():
    """A saturated softmax gives regions exactly 0 weight; 0 log 0 must count as 0 and not poison the gradient."""
    scores = torch.tensor([[5.0, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 9]], requires_grad=True)
    mask = torch.tensor([[True, True, False, False], [True, True, True, False], [False, False, True, True]])
    alphas = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (3, 4) with exact zeros
    out, tokens, _ = _packed([3], V=5, L=4, alphas=alphas)
    loss = caption_loss(out, tokens, entropy_weight=1.0)
    expected = -sum(float(a * a.log()) for a in alphas.detach()[mask]) / 3
    assert loss.entropy.item() == pytest.approx(expected, rel=1e-5)
    loss.total.backward()
    assert torch.isfinite(scores.grad).all() and (scores.grad[~mask] == 0).all()


# --- concept supervision: a word detector from the captions, and maps pulled towards it -----------

def _concept_output(concepts, alphas, tokens):
    """One photo (row 0) with one caption `tokens` (1, T + 1), its packed positions in order."""
    T = tokens.size(1) - 1
    return DecoderOutput(torch.zeros(T, concepts.size(-1)), alphas, torch.zeros(T, dtype=torch.long),
                         torch.arange(T), torch.zeros(1, dtype=torch.long), concepts)


def test_concept_detection_is_noisy_or_multiple_instance_learning():
    from captioner.training.loss import concept_detection

    V, L = 7, 4
    tokens = torch.tensor([[1, 5, 2]])  # <start> w5 <end>: the photo shows word 5, not 4 or 6
    rows = torch.zeros(1, dtype=torch.long)
    right = torch.full((1, L, V), -8.0)
    right[0, 2, 5] = 8.0  # one region shows word 5
    wrong = torch.full((1, L, V), -8.0)
    wrong[0, 2, 6] = 8.0  # a region claims word 6 instead
    assert concept_detection(right, tokens, rows) < 0.01 < concept_detection(wrong, tokens, rows)
    scores = torch.randn(1, L, V)
    p = 1 - torch.prod(1 - torch.sigmoid(scores[0]), dim=0)  # (V,) noisy-OR
    y = torch.tensor([0, 0, 0, 0, 0, 1, 0.0])
    want = F.binary_cross_entropy(p[4:], y[4:])
    torch.testing.assert_close(concept_detection(scores, tokens, rows), want, rtol=1e-4, atol=1e-5)


def test_concept_attention_pulls_a_content_words_map_towards_its_detector():
    from captioner.training.loss import concept_attention
    from captioner.training.teachers import detector_teacher

    V, L = 7, 4
    tokens = torch.tensor([[1, 4, 5, 2]])  # <start> the(4) dog(5) <end>
    concepts = torch.zeros(1, L, V)
    concepts[0, 3, 5] = 10.0  # the detector finds "dog" in region 3
    alphas = torch.full((3, L), 1.0 / L, requires_grad=True)
    content = torch.tensor([False] * 5 + [True, True])  # "the" is a function word: not pulled
    out = _concept_output(concepts, alphas, tokens)
    loss = concept_attention(out, tokens[0, 1:], detector_teacher(content))
    loss.backward()
    assert alphas.grad[0].abs().sum() == 0 and alphas.grad[2].abs().sum() == 0  # "the" and <end>
    assert alphas.grad[1, 3] < 0 and (alphas.grad[1, :3] > alphas.grad[1, 3]).all()  # more weight on region 3
    # the teacher is detached: the detector is not pulled towards the maps
    concepts.requires_grad_(True)
    fresh = torch.full((3, L), 1.0 / L, requires_grad=True)
    concept_attention(_concept_output(concepts, fresh, tokens), tokens[0, 1:], detector_teacher(content)).backward()
    assert concepts.grad is None and fresh.grad is not None


def test_a_concept_weight_needs_the_detector():
    from captioner.config import Config, ConfigError, ModelConfig, TrainConfig

    with pytest.raises(ConfigError, match="model.decoder.concepts"):
        Config(train=TrainConfig(concept_weight=1.0))
    Config(train=TrainConfig(concept_weight=1.0), model=ModelConfig(decoder=dataclasses.replace(
        ModelConfig().decoder, concepts=True)))
    with pytest.raises(ConfigError, match=r"'detector\+clothing' needs the ImageNet classifier"):
        Config(train=TrainConfig(concept_teacher="detector+clothing"),
               model=ModelConfig(encoder=dataclasses.replace(ModelConfig().encoder, name="resnet50")))


def test_imagenet_teacher_maps_a_word_by_the_classifier_at_each_region():
    """A toy classifier of 3 regions' 2-d features: class 151 (a dog breed) fires on feature x, so the
    teacher's map for "dog" peaks where x is largest; a word without classes is not taught."""
    from captioner.data.vocab import Vocabulary
    from captioner.training.teachers import ImageNetTeacher

    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "dog", "man"])  # ids 4, 5
    weight, bias = torch.zeros(1000, 2), torch.zeros(1000)
    weight[151, 0] = 5.0  # a dog breed: feature 0
    weight[805, 1] = 5.0  # a soccer ball: feature 1, not a dog
    teacher = ImageNetTeacher(weight, bias, vocab)
    grid = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.2, 0.0]]])  # (N=1, L=3, D=2)
    tokens = torch.tensor([[1, 4, 5, 2]])  # <start> dog man <end>
    out = DecoderOutput(torch.zeros(3, 6), torch.full((3, 3), 1 / 3), torch.zeros(3, dtype=torch.long),
                        torch.arange(3), torch.zeros(1, dtype=torch.long), None, grid)
    keep, scores = teacher(out, tokens[0, 1:])
    assert keep.tolist() == [True, False, False]  # "dog" only: "man" has no ImageNet class, <end> neither
    assert scores.shape == (1, 3) and int(scores.argmax()) == 1


def test_grouped_concepts_share_one_detector_output():
    """man and woman name one kind of thing: grouped, both read the output of the group's first word,
    and a photo captioned "woman" trains that output as present."""
    from captioner.data.vocab import Vocabulary
    from captioner.training.loss import concept_detection
    from captioner.model.concepts import concept_slots

    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "grass", "man", "woman", "dog", "puppy"])
    slots = concept_slots(vocab, grouped=True)
    assert slots[vocab.id("woman")] == slots[vocab.id("man")] and slots[vocab.id("puppy")] == vocab.id("dog")
    assert slots[vocab.id("grass")] == vocab.id("grass") and concept_slots(vocab, False).tolist() == list(range(9))
    L = 3
    scores = torch.full((1, L, 9), -8.0)
    scores[0, 1, vocab.id("man")] = 8.0  # the person output fires in region 1
    tokens = torch.tensor([[1, vocab.id("woman"), 2]])
    rows = torch.zeros(1, dtype=torch.long)
    assert concept_detection(scores, tokens, rows, slots) < 0.01  # "woman" is a person: present
    assert concept_detection(scores, tokens, rows) > 1.0  # ungrouped, the "woman" output never fired


def test_the_detector_scores_the_batchs_words_and_a_sample_of_others():
    """`detector_outputs` names every output a batch's words stand for (grouped: "woman" trains the
    person output) plus drawn others; the decoder scores just those columns, and the detection loss
    and the teacher read them as they read the same columns of a pass over all V."""
    from captioner.config import DecoderConfig, TrainConfig
    from captioner.data.vocab import Vocabulary
    from captioner.model.decoder import AttentionDecoder
    from captioner.training.loss import build_criterion, concept_detection, detector_outputs
    from captioner.model.concepts import concept_slots
    from captioner.training.teachers import detector_teacher

    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "man", "woman", "dog"] + [f"w{i}" for i in range(40)]
    vocab = Vocabulary(words)
    slots = concept_slots(vocab, grouped=True)
    tokens = torch.tensor([[1, 4, 6, 2, 0], [1, 7, 4, 4, 2]])  # "a woman", "dog a a"
    torch.manual_seed(0)
    ids = detector_outputs(tokens, slots, len(vocab), negatives=5)
    assert ids.tolist() == sorted(set(ids.tolist())) and min(ids.tolist()) >= 4
    assert {4, 5, 7} <= set(ids.tolist()) and 6 not in ids.tolist()  # woman -> the person output (man's)
    assert 3 + 1 <= len(ids) <= 3 + 5  # the batch's three outputs and at most five drawn
    assert detector_outputs(tokens, slots, len(vocab), negatives=-1) is True

    cfg = DecoderConfig(embed_dim=8, hidden_dim=12, attention_dim=10, dropout=0.0, feature_dim=10, concepts=True)
    dec = AttentionDecoder(len(vocab), 16, cfg, grid=(2, 2)).eval()
    features, lengths, rows = torch.randn(1, 4, 16), torch.tensor([3, 4]), torch.tensor([0, 0])
    full, part = dec(features, tokens, lengths, rows), dec(features, tokens, lengths, rows, detect=ids)
    assert full.detected is None and part.detected is ids and part.concepts.shape == (1, 4, len(ids))
    torch.testing.assert_close(part.concepts, full.concepts[:, :, ids])
    assert dec(features, tokens, lengths, rows, detect=False).concepts is None
    # the loss over the scored outputs is the full loss over the same columns
    present = torch.zeros(1, len(vocab))
    present[0, [5, 7, 4]] = 1.0
    log_absent = -F.softplus(full.concepts).sum(1)
    nll = -(present * torch.log(-torch.expm1(log_absent)) + (1 - present) * log_absent)[0, ids]
    torch.testing.assert_close(concept_detection(part.concepts, tokens, rows, slots, ids), nll.mean(),
                               rtol=1e-4, atol=1e-5)
    # the teacher reads each word's output in its own column
    content = torch.tensor([w not in ("<pad>", "<start>", "<end>", "<unk>", "a") for w in words])
    targets = tokens[part.caption, part.step + 1]
    keep, scores = detector_teacher(content, slots)(part, targets)
    keep_full, scores_full = detector_teacher(content, slots)(full, targets)
    assert keep.tolist() == keep_full.tolist() and keep.sum() == 2  # woman, dog
    torch.testing.assert_close(scores, scores_full)
    # the run's criterion: a sample from a large vocabulary, every output from a small one
    train = TrainConfig(concept_weight=1.0, concept_negatives=5)
    assert isinstance(build_criterion(train, vocab).detector_outputs(tokens), torch.Tensor)
    assert build_criterion(dataclasses.replace(train, concept_negatives=-1), vocab).detector_outputs(tokens) is True
    assert build_criterion(dataclasses.replace(train, concept_negatives=60), vocab).detector_outputs(tokens) is True


def test_a_cross_entropy_step_trains_only_the_detector_outputs_it_scored():
    """The objective asks the criterion which outputs to score: the detector rows of every other word
    get no gradient (and cost nothing), the batch's words do."""
    from captioner.config import DecoderConfig, TrainConfig
    from captioner.data.datasets import Batch
    from captioner.data.vocab import Vocabulary
    from captioner.model.decoder import AttentionDecoder
    from captioner.training.loss import build_criterion
    from captioner.training.objective import CrossEntropy

    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(60)])
    train = TrainConfig(concept_weight=1.0, concept_negatives=3)
    criterion = build_criterion(train, vocab)
    asked = []
    criterion.detector_outputs = lambda tokens, ask=criterion.detector_outputs: asked.append(ask(tokens)) or asked[-1]
    cfg = DecoderConfig(embed_dim=8, hidden_dim=12, attention_dim=10, dropout=0.0, feature_dim=10, concepts=True)
    dec = AttentionDecoder(len(vocab), 16, cfg, grid=(2, 2))
    tokens = torch.tensor([[1, 10, 11, 2], [1, 12, 2, 0]])
    batch = Batch(torch.randn(1, 4, 16), tokens, torch.tensor([3, 2]), torch.tensor([7, 7]), torch.tensor([0, 0]))
    CrossEntropy(dec, train, criterion, torch.device("cpu")).loss(batch).loss.total.backward()
    scored = set(asked[0].tolist())
    assert {10, 11, 12} <= scored and len(scored) <= 6
    trained = {i for i in range(len(vocab)) if dec.concepts.weight.grad[i].abs().sum() > 0}
    assert trained == scored


def test_the_clothing_prior_finds_where_people_wear_things_and_computes_each_photo_once():
    """A toy classifier of 2-d region features: class 610 (a jersey) fires on feature 0, a dog breed on
    feature 1. The prior's log P(clothing) is highest where feature 0 is; a photo given its id is
    computed once (a cached grid never changes), a grid without an id every time."""
    from captioner.training.teachers import ClothingPrior

    weight, bias = torch.zeros(1000, 2), torch.zeros(1000)
    weight[610, 0] = weight[151, 1] = 8.0
    prior = ClothingPrior(weight, bias)
    grid = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]])  # (N=1, L=3, D=2): dog, jersey, nothing
    logp = prior(grid, torch.tensor([7]))
    assert logp.shape == (1, 3) and int(logp.argmax()) == 1 and float(logp.max()) > math.log(0.5)
    expected = torch.log_softmax(grid @ weight.T + bias, -1)[..., list(prior.clothing)].logsumexp(-1)
    torch.testing.assert_close(logp, expected)
    other = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])  # another photo's grid...
    torch.testing.assert_close(prior(other, torch.tensor([7])), logp)  # ...under photo 7's id: kept
    assert int(prior(other, torch.tensor([8])).argmax()) == 0 and int(prior(other).argmax()) == 0


def test_the_classifier_teachers_read_a_two_scale_grid_by_its_last_stage_channels():
    """A two-scale grid (`model.encoder.two_scale`) puts the finer stage's channels first: the ImageNet
    classifier must see only the last D, whatever the finer ones hold."""
    from captioner.training.teachers import ClothingPrior

    weight, bias = torch.zeros(1000, 2), torch.zeros(1000)
    weight[610, 0] = weight[151, 1] = 8.0
    grid = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]])  # (1, 3, D=2)
    finer = torch.tensor([[[9.0, 9.0, 9.0], [-9.0, 0.0, 5.0], [0.0, 3.0, 0.0]]])  # (1, 3, d=3)
    two_scale = torch.cat([finer, grid], dim=-1)  # (1, 3, 5)
    torch.testing.assert_close(ClothingPrior(weight, bias)(two_scale), ClothingPrior(weight, bias)(grid))


def test_the_clothing_teacher_moves_a_persons_map_onto_what_people_wear_and_no_other_word():
    """The detector finds "man" on region 0 (the street people stand on) and "dog" on region 2; the
    classifier sees clothing on region 1. With the prior the teacher's map for "man" peaks on region 1;
    "dog" keeps its detector map; without the prior "man" stays on the street."""
    from captioner.data.vocab import Vocabulary
    from captioner.training.teachers import ClothingPrior, content_words, detector_teacher, person_words

    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "man", "dog"])
    assert person_words(vocab).tolist() == [False] * 4 + [True, False]
    weight, bias = torch.zeros(1000, 2), torch.zeros(1000)
    weight[834, 0] = 8.0  # a suit: feature 0
    grid = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # (1, L=3, 2)
    concepts = torch.zeros(1, 3, 6)
    concepts[0, 0, 4] = 2.0  # "man" fires on the street...
    concepts[0, 1, 4] = 1.0  # ...and a little on the person
    concepts[0, 2, 5] = 3.0  # "dog"
    tokens = torch.tensor([[1, 4, 5, 2]])  # <start> man dog <end>
    out = DecoderOutput(torch.zeros(3, 6), torch.full((3, 3), 1 / 3), torch.zeros(3, dtype=torch.long),
                        torch.arange(3), torch.zeros(1, dtype=torch.long), concepts, grid)
    content = content_words(vocab)
    keep, plain = detector_teacher(content)(out, tokens[0, 1:])
    keep2, primed = detector_teacher(content, None, person_words(vocab), ClothingPrior(weight, bias))(
        out, tokens[0, 1:], torch.tensor([3]))
    assert keep.tolist() == keep2.tolist() == [True, True, False]
    assert int(plain[0].argmax()) == 0 and int(primed[0].argmax()) == 1  # man: the street -> the suit
    torch.testing.assert_close(primed[1], plain[1])  # dog: untouched


def test_a_cross_entropy_step_tells_the_teacher_which_photo_each_cached_grid_is():
    """Cached grids carry their image ids to the criterion: row n of the batch's grids is photo
    images[n], so a teacher can keep what it computed of a photo."""
    from captioner.config import DecoderConfig, TrainConfig
    from captioner.data.datasets import Batch
    from captioner.data.vocab import Vocabulary
    from captioner.model.decoder import AttentionDecoder
    from captioner.training.loss import build_criterion
    from captioner.training.objective import CrossEntropy

    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "b"])
    train = TrainConfig()
    loss, seen = build_criterion(train, vocab), []

    class Spy:
        def detector_outputs(self, tokens):
            return False

        def __call__(self, out, tokens, box_cells=None, images=None):
            seen.append(images)
            return loss(out, tokens)

    dec = AttentionDecoder(len(vocab), 4, DecoderConfig(embed_dim=4, hidden_dim=4, attention_dim=4, dropout=0.0),
                           grid=(1, 2))
    tokens = torch.tensor([[1, 4, 2], [1, 5, 2], [1, 4, 2]])
    batch = Batch(torch.randn(2, 2, 4), tokens, torch.tensor([2, 2, 2]), torch.tensor([9, 4, 9]),
                  torch.tensor([1, 0, 1]))
    CrossEntropy(dec, train, Spy(), torch.device("cpu")).loss(batch)
    assert seen[0].tolist() == [4, 9]
