"""Self-critical training: on-policy log-probabilities with a gradient, a baseline without one, a
reward that rises, and the same exact resume as cross-entropy training."""
from __future__ import annotations

import json

import pytest
import torch

from captioner.config import ConfigError, load_config
from captioner.data.sources import load_records
from captioner.data.vocab import tokenize
from captioner.decoding.cider import CiderD
from captioner.decoding.sampling import sample
from captioner.model.checkpoint import load_checkpoint, restore_model
from captioner.recipes.train import run_config, train

TINY = """\
data: {path: shapes, shapes_images: 100}
model:
  encoder: {name: random, image_size: 64}
  decoder: {embed_dim: 16, hidden_dim: 32, attention_dim: 16, dropout: 0.2, feature_dim: 16}
train: {epochs: 4, batch_size: 20, lr: 0.005, patience: 0, amp: "off"}
decode: {beam_size: 2, max_length: 12}
"""
SCST = ["train.objective=scst", "train.epochs=4", "train.lr=3e-3", "train.schedule=constant"]


def _restored(path):
    """The checkpoint's model in eval mode, and the checkpoint."""
    ckpt = load_checkpoint(path)
    return restore_model(ckpt, path).eval(), ckpt


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A cross-entropy checkpoint to fine-tune, and the config file."""
    tmp = tmp_path_factory.mktemp("scst")
    (tmp / "tiny.yaml").write_text(TINY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result = train(run_config(tmp / "tiny.yaml", []), tmp / "ce", "cpu")
    torch.set_num_threads(threads)
    return tmp / "tiny.yaml", result.best


def _mean_sample_reward(checkpoint, config) -> float:
    """Mean CIDEr-D of 5 captions sampled (seed fixed) per training image."""
    model, ckpt = _restored(checkpoint)
    records = [r for r in load_records(load_config(config).data) if r.split == "train"]
    refs = [[tokenize(c) for c in r.captions] for r in records]
    transform = model.encoder.transform()
    from captioner.data.images import load_image

    features = model.encoder.infer(torch.stack([transform(load_image(r.image)) for r in records]))
    torch.manual_seed(0)
    v = ckpt.vocab
    tokens, _ = sample(model.decoder, features, 5, 12, v.start_id, v.end_id, v.pad_id, (v.pad_id, v.start_id, v.unk_id))
    words = [v.decode(row) for row in tokens.tolist()]
    return float(CiderD(refs).scores(words, [refs[i // 5] for i in range(len(words))]).mean())


def test_a_few_scst_epochs_raise_the_reward_of_the_sampled_captions(start, tmp_path):
    config, ce = start
    result = train(run_config(config, [*SCST, f"train.init={ce}"]), tmp_path / "scst", "cpu")
    lines = [json.loads(ln) for ln in (tmp_path / "scst" / "metrics.jsonl").read_text().splitlines()]
    assert all("reward" in ln and 0 < ln["reward_share"] < 1 for ln in lines) and result.steps == 4 * 20  # 80 images, 4 (20 captions) per step
    before, after = _mean_sample_reward(ce, config), _mean_sample_reward(result.last, config)
    print(f"mean reward of sampled captions: {before:.3f} -> {after:.3f}")
    assert after > before + 0.1  # measured: 0.671 -> 0.895
    assert load_checkpoint(result.last).config.train.init == str(ce)


def test_the_sampled_log_probs_get_a_gradient_and_the_baseline_none(start):
    config, ce = start
    from captioner.data.datasets import ImageBatch
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    cfg = run_config(config, [*SCST, f"train.init={ce}"])
    refs = [("a red circle", "there is a red circle"), ("a blue square and a green triangle",)]
    scst = SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False)
    batch = ImageBatch(torch.rand(2, 3, 64, 64), torch.tensor([0, 1]))
    model.decoder.train()
    torch.manual_seed(1)
    cost = scst.loss(batch)
    loss = cost.loss
    assert (cost.captions, cost.tokens) == (10, 10)  # 2 images, 5 samples each
    assert loss.total.requires_grad and not loss.reward.requires_grad
    loss.total.backward()
    grads = [p.grad for p in model.decoder.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert model.decoder.training  # back in train mode (it sampled in eval mode)

    # the same loss written out: -(reward - mean of the other samples) * log p, the advantage a constant
    torch.manual_seed(1)
    model.zero_grad()
    features = model.encoder.infer(batch.inputs).clone()
    model.decoder.eval()
    v = ckpt.vocab
    tokens, lengths = sample(model.decoder, features, 5, cfg.decode.max_length, v.start_id, v.end_id, v.pad_id,
                             (v.pad_id, v.start_id, v.unk_id))
    reward = scst.rewards(scst.words(tokens), [0] * 5 + [1] * 5).view(2, 5)
    advantage = (reward - (reward.sum(1, keepdim=True) - reward) / 4).view(-1)
    seqs = torch.cat([torch.full((10, 1), v.start_id), tokens], 1)
    out = model.decoder(features, seqs, lengths, torch.arange(2).repeat_interleave(5))
    logp = scst._token_log_probs(out.logits, seqs[out.caption, out.step + 1], out.step)
    expected = -(advantage[out.caption] * logp).mean()
    assert loss.total.item() == pytest.approx(expected.item(), rel=1e-5)


def _policy_loss(scst, model, features, advantage_of, seed):
    """-(advantage * log p) over the sampled words, written out: the samples drawn as the loss draws
    them (seed, eval mode), `advantage_of(reward (N·K,), words)` the advantage of each sample."""
    v, K = scst.vocab, scst.cfg.scst_samples
    torch.manual_seed(seed)
    model.decoder.eval()
    tokens, lengths = sample(model.decoder, features, K, scst.max_length, v.start_id, v.end_id, v.pad_id,
                             (v.pad_id, v.start_id, v.unk_id))
    return _loss_of(scst, model, features, tokens, lengths, advantage_of)


def _loss_of(scst, model, features, tokens, lengths, advantage_of):
    """-(advantage * log p) over the words of given captions (R, T), K per image."""
    v, K = scst.vocab, scst.cfg.scst_samples
    words = scst.words(tokens)
    reward = scst.rewards(words, [i for i in range(len(features)) for _ in range(K)])
    seqs = torch.cat([torch.full((len(tokens), 1), v.start_id), tokens], 1)
    out = model.decoder(features, seqs, lengths, torch.arange(len(features)).repeat_interleave(K))
    logp = scst._token_log_probs(out.logits, seqs[out.caption, out.step + 1], out.step)
    return -(advantage_of(reward, words)[out.caption] * logp).mean()


def test_the_greedy_baseline_is_the_reward_of_the_images_greedy_caption(start):
    """`scst_baseline: greedy`: each sample is judged against the CIDEr-D of its image's greedy
    (beam 1) caption, the same for all K samples of an image."""
    config, ce = start
    from captioner.config import DecodeConfig
    from captioner.data.datasets import ImageBatch
    from captioner.decoding.search import decode
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    cfg = run_config(config, [*SCST, f"train.init={ce}", "train.scst_baseline=greedy", "train.scst_samples=3"])
    refs = [("a red circle", "there is a red circle"), ("a blue square and a green triangle",)]
    scst = SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False)
    images = torch.rand(2, 3, 64, 64)
    torch.manual_seed(3)
    cost = scst.loss(ImageBatch(images, torch.tensor([0, 1])))

    features = model.encoder.infer(images).clone()
    model.decoder.eval()
    greedy = [ckpt.vocab.decode(h.tokens) for h in
              decode(model.decoder, features, DecodeConfig(beam_size=1, max_length=cfg.decode.max_length), ckpt.vocab)]
    cider = CiderD([[tokenize(c) for c in caps] for caps in refs])
    baseline = torch.as_tensor(cider.scores(greedy, [[tokenize(c) for c in caps] for caps in refs]),
                               dtype=torch.float32)  # (2,) one per image
    assert torch.equal(scst._baseline(torch.zeros(6), features, [0, 1]), baseline.repeat_interleave(3))

    expected = _policy_loss(scst, model, features, lambda reward, _: reward - baseline.repeat_interleave(3), seed=3)
    assert cost.loss.total.item() == pytest.approx(expected.item(), rel=1e-5)
    # a sample that is the greedy caption itself gets no push either way
    assert scst.rewards([greedy[0]], [0]).item() == pytest.approx(baseline[0].item())


def test_the_object_penalty_charges_each_kind_no_reference_names(start):
    """`scst_object_penalty: p`: a sample's reward is its CIDEr-D less p for each object kind it
    names that no reference of its image names ("a bench" where they saw grass; a cat and a frisbee:
    two); kinds a reference names ("dog", "man"), and words that are no object kind, cost nothing."""
    config, ce = start
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    refs = [("a dog runs on the grass", "a brown dog plays"), ("a man sits on a bench",)]
    captions = [tokenize(c) for c in ("a dog on a bench", "a man on a bench", "a cat and a frisbee on the grass")]
    image_ids = [0, 1, 0]
    rewards = {}
    for penalty in (0.0, 0.5):
        cfg = run_config(config, [*SCST, f"train.init={ce}", f"train.scst_object_penalty={penalty}"])
        scst = SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False)
        rewards[penalty] = scst.rewards(captions, image_ids)
    assert [scst.hallucinated(c, i) for c, i in zip(captions, image_ids)] == [1, 0, 2]
    assert rewards[0.0].tolist() == pytest.approx(
        CiderD([[tokenize(c) for c in caps] for caps in refs]).scores(
            captions, [[tokenize(c) for c in refs[i]] for i in image_ids]).tolist())
    assert (rewards[0.0] - rewards[0.5]).tolist() == pytest.approx([0.5, 0.0, 1.0])


def test_beam_sampling_trains_on_each_images_best_beams_against_their_mean(start):
    """`scst_sampling: beam`: an image's K captions are its K best beams under the run's decode
    rules (beam size K), each judged against the mean reward of the other K - 1."""
    config, ce = start
    from captioner.data.datasets import ImageBatch
    from captioner.decoding.search import decode_n_best
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    cfg = run_config(config, [*SCST, f"train.init={ce}", "train.scst_sampling=beam", "train.scst_samples=3",
                              "decode.no_repeat_ngram=2"])
    refs = [("a red circle", "there is a red circle"), ("a blue square and a green triangle",)]
    scst = SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False)
    images = torch.rand(2, 3, 64, 64)
    cost = scst.loss(ImageBatch(images, torch.tensor([0, 1])))

    features = model.encoder.infer(images).clone()
    model.decoder.eval()
    v = ckpt.vocab
    beams = decode_n_best(model.decoder, features, cfg.decode.with_overrides(beam_size=3), v, 3)
    assert [len(b) for b in beams] == [3, 3]
    tokens, lengths = scst._draw(features)
    assert scst.words(tokens) == [v.decode(h.tokens) for b in beams for h in b]
    assert lengths.tolist() == [len(h.tokens) + h.finished for b in beams for h in b]

    def leave_one_out(reward, _):
        by_image = reward.view(2, 3)
        return (by_image - (by_image.sum(1, keepdim=True) - by_image) / 2).view(-1)

    expected = _loss_of(scst, model, features, tokens, lengths, leave_one_out)
    assert cost.loss.total.item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_cross_entropy_mix_adds_the_references_teacher_forced_cross_entropy(start):
    """`scst_xent_weight: w`: loss = policy + w * the cross-entropy of the batch images' reference
    captions, the same number the cross-entropy objective's criterion gives them."""
    config, ce = start
    from captioner.data.datasets import CaptionItem, ImageBatch, collate
    from captioner.training.loss import caption_loss
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    v = ckpt.vocab
    refs = [("a red circle", "there is a red circle"), ("a blue square and a green triangle",)]
    images = torch.rand(2, 3, 64, 64)
    features = model.encoder.infer(images).clone()
    losses = {}
    for w in (0.0, 0.7):
        cfg = run_config(config, [*SCST, f"train.init={ce}", f"train.scst_xent_weight={w}"])
        scst = SelfCritical(model, model.decoder, refs, v, cfg.train, cfg.decode, cached=False)
        torch.manual_seed(5)
        losses[w] = scst.loss(ImageBatch(images, torch.tensor([0, 1]))).loss

    model.decoder.eval()  # the loss is computed in eval mode: no dropout
    items = [CaptionItem(features[n], torch.tensor(v.encode(c, cfg.decode.max_length)), n)
             for n, caps in enumerate(refs) for c in caps]
    batch = collate(items)
    out = model.decoder(batch.inputs, batch.tokens, batch.lengths, batch.rows)
    reference_xent = caption_loss(out, batch.tokens).xent

    assert losses[0.0].xent.item() == 0.0  # not computed without its weight
    assert losses[0.7].xent.item() == pytest.approx(reference_xent.item(), rel=1e-5)
    policy = _policy_loss(scst, model, features, lambda reward, _: reward - (reward.view(2, 5).sum(1, keepdim=True)
                                                                            - reward.view(2, 5)).view(-1) / 4, seed=5)
    assert losses[0.0].total.item() == pytest.approx(policy.item(), rel=1e-5)
    assert losses[0.7].total.item() == pytest.approx(policy.item() + 0.7 * reference_xent.item(), rel=1e-5)
    assert losses[0.7].xent.requires_grad  # it trains the decoder too


@pytest.mark.parametrize("kl", [[], ["train.scst_kl_weight=0.5"]], ids=["plain", "kl"])
def test_a_stopped_scst_run_resumes_exactly(start, tmp_path, kl):
    config, ce = start
    cfg = run_config(config, [*SCST, f"train.init={ce}", "train.epochs=2", *kl])
    full = train(cfg, tmp_path / "full", "cpu")
    stopped = train(cfg, tmp_path / "run", "cpu", stop_after_steps=30)  # mid second epoch
    assert stopped.steps == 30 and stopped.interrupted is None
    last = tmp_path / "run" / "last.pt"
    resumed = train(run_config(None, [], resume=last), tmp_path / "run", "cpu", resume=last)
    assert resumed.steps == full.steps == 40
    a, b = load_checkpoint(full.last).model_state, load_checkpoint(resumed.last).model_state
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_kl_term_is_zero_at_the_start_and_pulls_back_towards_it(start):
    config, ce = start
    from captioner.data.datasets import ImageBatch
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    initial, _ = _restored(ce)
    cfg = run_config(config, [*SCST, f"train.init={ce}", "train.scst_kl_weight=1.0"])
    refs = [("a red circle",), ("a blue square",)]
    scst = SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False,
                        initial=initial.decoder)
    assert not any(p.requires_grad for p in initial.decoder.parameters())
    features = model.encoder.infer(torch.rand(2, 3, 64, 64)).clone()  # usable by autograd
    v = ckpt.vocab
    torch.manual_seed(0)
    tokens, lengths = sample(model.decoder, features, 5, 12, v.start_id, v.end_id, v.pad_id, (v.pad_id,))
    seqs = torch.cat([torch.full((10, 1), v.start_id), tokens], 1)
    rows = torch.arange(2).repeat_interleave(5)

    def kl() -> torch.Tensor:
        return scst._kl_from_initial(model.decoder(features, seqs, lengths, rows).logits, features, seqs, lengths, rows)

    model.decoder.eval()
    assert abs(kl().item()) < 1e-6  # the same model
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drifted = kl()
    assert drifted.item() > 1e-3
    drifted.backward()
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.sub_(0.5 * p.grad)
    assert kl().item() < drifted.item()  # its gradient leads back towards the initial model

    # ... and the full loss carries it: without the initial decoder the weight is refused
    with pytest.raises(ValueError, match="initial decoder"):
        SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False)
    model.decoder.train()
    assert scst.loss(ImageBatch(torch.rand(2, 3, 64, 64), torch.tensor([0, 1]))).loss.total.requires_grad


class _Detector(torch.nn.Module):
    """A word detector that counts the passes that run it."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return features


def test_self_critical_training_never_runs_the_word_detector(start):
    """The detector (`model.decoder.concepts`) feeds only cross-entropy's concept terms: SCST's three
    teacher-forced passes (its samples, the KL's initial model, the references' cross-entropy) skip it."""
    config, ce = start
    from captioner.data.datasets import ImageBatch
    from captioner.training.scst import SelfCritical

    model, ckpt = _restored(ce)
    initial, _ = _restored(ce)
    model.decoder.concepts, initial.decoder.concepts = _Detector(), _Detector()
    cfg = run_config(config, [*SCST, f"train.init={ce}", "train.scst_kl_weight=0.5", "train.scst_xent_weight=0.5"])
    refs = [("a red circle",), ("a blue square",)]
    scst = SelfCritical(model, model.decoder, refs, ckpt.vocab, cfg.train, cfg.decode, cached=False,
                        initial=initial.decoder)
    model.decoder.train()
    loss = scst.loss(ImageBatch(torch.rand(2, 3, 64, 64), torch.tensor([0, 1]))).loss
    assert loss.total.requires_grad and loss.xent.item() > 0
    assert model.decoder.concepts.runs == initial.decoder.concepts.runs == 0
    features = model.encoder.infer(torch.rand(1, 3, 64, 64)).clone()
    tokens = torch.tensor([[ckpt.vocab.start_id, 4, ckpt.vocab.end_id]])
    assert model.decoder(features, tokens, torch.tensor([2])).concepts is features  # cross-entropy's pass runs it
    assert model.decoder(features, tokens, torch.tensor([2]), detect=False).concepts is None


def test_scst_without_an_initial_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="'scst' needs train.init"):
        load_config(None, ["train.objective=scst"])
    with pytest.raises(ConfigError, match="scst_samples"):
        load_config(None, ["train.objective=scst", "train.init=x.pt", "train.scst_samples=1"])


def test_a_detector_weight_the_model_cannot_honour_is_refused_before_any_training(start, tmp_path):
    """`decode.detector_weight` needs a word detector: refused with the config when the config builds the
    model, and when the model comes from `--init`, as soon as it is loaded (before data, before a step)."""
    config, ce = start  # a model without a word detector
    with pytest.raises(ConfigError, match="needs the word detector"):
        load_config(config, ["decode.detector_weight=0.5"])
    with pytest.raises(ConfigError, match="no word detector"):
        train(run_config(config, [*SCST, f"train.init={ce}", "decode.detector_weight=0.5"]), tmp_path / "run", "cpu")
    assert not list((tmp_path / "run").glob("*.pt"))
