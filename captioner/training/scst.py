"""Self-critical sequence training (Rennie et al. 2017), with the "new self-critical" baseline of
Luo (2020): fine-tune a cross-entropy model to raise the CIDEr-D of its own captions.

For each image of a batch the model samples K captions (`train.scst_samples`); each is rewarded
with its CIDEr-D against the image's references (document frequencies from all training references,
fixed once), and pushed up or down by how much better it did than the mean reward of the image's
other K - 1 samples (or than the image's greedy caption, `scst_baseline: greedy`). With
`scst_sampling: beam` the K captions are instead the image's K best beams, searched with the run's
decode rules: the captions evaluation writes, not draws from the whole distribution (the SCST of
Cornia et al. 2020, Meshed-Memory Transformer):

    loss = -mean over sampled words of (reward - baseline) * log p(word)

The samples are drawn without gradients, in eval mode (no dropout); their log-probabilities then
come from the packed teacher-forced pass over them, also in eval mode, so the gradient is that of
the distribution sampled from (for beams: the model's own probabilities of them, without the search's
n-gram and repeated-word rules). The baseline never gets a gradient. `scst_object_penalty` lowers a
sample's reward by that much for each object kind it names that no reference of its image names (CHAIR's
hallucinated mentions, `captioner.decoding.hallucination`): CIDEr-D alone charges a wrong "bench" no more
than any other wrong word. `scst_xent_weight` mixes in the
cross-entropy of the references; `scst_kl_weight` the KL divergence of the policy from the frozen
initial model at every sampled position (as RL fine-tuning of language models does), which holds the
policy near its cross-entropy start: on 700 training images SCST otherwise learns their references.

Shapes: N images, K samples per image, R = N·K sampled captions, T words, P scored positions.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioner.config import DecodeConfig, TrainConfig
from captioner.data.datasets import ImageBatch, collate_images, pad_captions
from captioner.data.vocab import Vocabulary, tokenize
from captioner.decoding.cider import CiderD
from captioner.decoding.hallucination import named_kinds, unnamed_words
from captioner.decoding.sampling import sample
from captioner.decoding.rules import ban
from captioner.decoding.search import decode, decode_n_best
from captioner.model.caption_model import CaptionModel
from captioner.training.loss import LossOutput
from captioner.training.objective import BatchLoss, logged_terms


class SelfCritical:
    """The SCST objective over batches of training images (`ImageBatch`: grids or pixels, image ids).

    Args:
        model: the captioning model (its encoder frozen).
        net: what computes the teacher-forced pass with gradients: the decoder, DDP-wrapped when
            distributed.
        references: raw reference captions of each training image, by image id.
        vocab, train_cfg, decode_cfg: the run's.
        cached: the batches hold cached grids (else images for the frozen encoder).
        initial: the frozen initial decoder, for `scst_kl_weight` (None without it).
        device, amp_dtype: where the steps run, and under which autocast dtype (None: float32).
    """

    MIN_LENGTH = 1  # words before <end> may be drawn (as decoding has it)
    collate = staticmethod(collate_images)  # batches of images

    def __init__(self, model: CaptionModel, net: nn.Module, references: Sequence[Sequence[str]], vocab: Vocabulary,
                 train_cfg: TrainConfig, decode_cfg: DecodeConfig, cached: bool, initial: nn.Module | None = None,
                 device: torch.device | None = None, amp_dtype: torch.dtype | None = None) -> None:
        if train_cfg.scst_kl_weight and initial is None:
            raise ValueError("scst_kl_weight needs the initial decoder")
        self.model, self.net, self.vocab, self.cfg, self.cached = model, net, vocab, train_cfg, cached
        self.device, self.amp_dtype = device or torch.device("cpu"), amp_dtype
        self.initial = None if initial is None else initial.eval().requires_grad_(False)
        self.max_length = decode_cfg.max_length
        # scst_sampling "beam": the K best beams as the decoder alone ranks them, without the word detector
        # (`decode.detector_weight`): with it in the beams, SCST seeds 0 / 1 from the recipe's seed 0 scored dev
        # CIDEr-D 0.588 / 0.583 against 0.603 / 0.603 (both decoded with it)
        self.beam_cfg = decode_cfg.with_overrides(beam_size=train_cfg.scst_samples, detector_weight=0.0)
        self.refs = [[tokenize(c) for c in caps] for caps in references]  # (images,) token lists
        self.cider = CiderD(self.refs)
        # (images,) the object kinds each image's references name, for scst_object_penalty (~6 s on Flickr8k's 5,856)
        self.kinds = [named_kinds(caps) for caps in references] if train_cfg.scst_object_penalty else []
        self.ref_ids = [[vocab.encode(c, decode_cfg.max_length) for c in refs] for refs in self.refs]
        self.banned = (vocab.pad_id, vocab.start_id, vocab.unk_id)
        self.reward_seconds = 0.0  # time spent computing rewards since the last metrics line

    def set_epoch(self, epoch: int) -> None:
        pass

    def log(self, means: Mapping[str, float], seconds: float) -> dict[str, float]:
        """The cross-entropy terms' entries, the samples' mean reward and the share of the step time
        spent computing rewards (then counted again from 0)."""
        share = round(self.reward_seconds / max(seconds, 1e-9), 4)
        self.reward_seconds = 0.0
        return {**logged_terms(means, self.cfg), "reward": means["reward"], "reward_share": share}

    def rewards(self, words: list[list[str]], image_ids: list[int]) -> Tensor:
        """(R,) CIDEr-D of each caption (tokens) against its image's references, less
        `scst_object_penalty` for each object kind it names that they do not."""
        tick = time.perf_counter()
        reward = torch.as_tensor(self.cider.scores(words, [self.refs[i] for i in image_ids]), dtype=torch.float32)
        if self.cfg.scst_object_penalty:
            wrong = [self.hallucinated(caption, i) for caption, i in zip(words, image_ids, strict=True)]  # (R,)
            reward -= self.cfg.scst_object_penalty * torch.tensor(wrong, dtype=torch.float32)
        self.reward_seconds += time.perf_counter() - tick
        return reward

    def hallucinated(self, words: list[str], image_id: int) -> int:
        """How many object kinds a caption (tokens) names that no reference of its image names."""
        return len(unnamed_words(" ".join(words), self.kinds[image_id]))

    def words(self, tokens: Tensor) -> list[list[str]]:
        """(R, T) sampled ids -> words up to <end>."""
        return [self.vocab.decode(row) for row in tokens.tolist()]

    def loss(self, batch: ImageBatch) -> BatchLoss:
        """The SCST loss of a batch (with gradients); `reward` is the samples' mean CIDEr-D."""
        K, decoder, device = self.cfg.scst_samples, self.model.decoder, self.device
        inputs = batch.inputs.to(device, non_blocking=True)
        image_ids = batch.image_ids.tolist()
        was_training = decoder.training
        decoder.eval()  # the log-probabilities of exactly the distribution sampled from
        try:
            with torch.autocast(device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
                # (N, L, D) grids; the encoder's output cloned so that autograd may use it
                features = inputs if self.cached else self.model.encoder.infer(inputs).clone()
                tokens, lengths = self._draw(features)  # (R, T), (R,)
                reward = self.rewards(self.words(tokens), [i for i in image_ids for _ in range(K)]).to(device)  # (R,)
                advantage = (reward - self._baseline(reward, features, image_ids)).detach()  # (R,) no gradient
                start = torch.full((len(tokens), 1), self.vocab.start_id, dtype=torch.long, device=device)
                seqs = torch.cat([start, tokens.to(device)], dim=1)  # (R, T + 1) what the decoder reads
                rows = torch.arange(len(image_ids), device=device).repeat_interleave(K)  # (R,) each sample's image
                out = self.net(features, seqs, lengths.to(device), rows, detect=False)  # packed: logits (P, V)
                logp = self._token_log_probs(out.logits, seqs[out.caption, out.step + 1], out.step)  # (P,)
                total = -(advantage[out.caption] * logp).mean()  # the policy gradient's loss
                xent = logp.new_zeros(())
                if self.cfg.scst_xent_weight:
                    xent = self._reference_xent(features, image_ids, device)
                total = total + self.cfg.scst_xent_weight * xent
                if self.initial is not None:
                    total = total + self.cfg.scst_kl_weight * self._kl_from_initial(out.logits, features, seqs, lengths,
                                                                                    rows)
        finally:
            decoder.train(was_training)
        zero = total.new_zeros(())
        return BatchLoss(LossOutput(total, xent, zero, zero, reward.mean(), zero), len(tokens), len(tokens))

    def _draw(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """K captions of each of the N images (`train.scst_sampling`): tokens (R, T), <end> where
        written, then <pad>; lengths (R,) the scored positions of each. Rows k·K .. k·K + K - 1 are
        image k's. Beam search may finish fewer than K beams of an image: its beams are then repeated."""
        K, v = self.cfg.scst_samples, self.vocab
        if self.cfg.scst_sampling == "multinomial":
            return sample(self.model.decoder, features, K, self.max_length, v.start_id, v.end_id, v.pad_id,
                          self.banned, self.MIN_LENGTH)
        ranked = decode_n_best(self.model.decoder, features, self.beam_cfg, v, K)  # N lists of <= K
        rows = [[v.start_id, *h.tokens] + [v.end_id] * h.finished for beams in ranked for h in (beams * K)[:K]]
        tokens, lengths = pad_captions(rows, v.pad_id)  # (R, T + 1) [<start>, words, <end>?, <pad>...]
        return tokens[:, 1:].to(features.device), lengths

    def _baseline(self, reward: Tensor, features: Tensor, image_ids: list[int]) -> Tensor:
        """(R,) what each sample's reward is measured against: the mean reward of its image's other
        K - 1 samples, or (`scst_baseline: greedy`) the reward of the image's greedy caption."""
        K = self.cfg.scst_samples
        if self.cfg.scst_baseline == "mean":
            by_image = reward.view(-1, K)  # (N, K)
            return ((by_image.sum(1, keepdim=True) - by_image) / (K - 1)).view(-1)  # (R,)
        greedy = decode(self.model.decoder, features, DecodeConfig(beam_size=1, max_length=self.max_length), self.vocab)
        words = [self.vocab.decode(h.tokens) for h in greedy]
        return self.rewards(words, image_ids).to(reward.device).repeat_interleave(K)  # (R,)

    def _token_log_probs(self, logits: Tensor, targets: Tensor, step: Tensor) -> Tensor:
        """(P, V) logits, (P,) targets and positions -> (P,) float32 log-probabilities of the targets
        under the distribution `sample` draws from (`ban`: banned ids, and <end> too early, masked)."""
        banned = torch.tensor(self.banned, device=logits.device)
        masked = ban(logits.float().clone(), banned, self.vocab.end_id, step < self.MIN_LENGTH)  # (P, V)
        return torch.log_softmax(masked, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)

    def _kl_from_initial(self, logits: Tensor, features: Tensor, seqs: Tensor, lengths: Tensor, rows: Tensor) -> Tensor:
        """Mean over the P sampled positions of KL(policy || initial model), from the policy's packed
        logits (P, V) and the frozen initial decoder's pass over the same samples (same packing)."""
        with torch.no_grad():
            initial = self.initial(features, seqs, lengths.to(seqs.device), rows, detect=False).logits
            initial = torch.log_softmax(initial.float(), -1)  # (P, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (P, V)
        return (logp.exp() * (logp - initial)).sum(-1).mean()

    def _reference_xent(self, features: Tensor, image_ids: list[int], device: torch.device) -> Tensor:
        """Cross-entropy of the batch images' reference captions (teacher forcing, packed)."""
        captions = [(n, ids) for n, i in enumerate(image_ids) for ids in self.ref_ids[i]]
        tokens, lengths = pad_captions([ids for _, ids in captions], self.vocab.pad_id)  # (C, T + 1), (C,)
        tokens, lengths = tokens.to(device), lengths.to(device)
        rows = torch.tensor([n for n, _ in captions], device=device)  # (C,)
        out = self.net(features, tokens, lengths, rows, detect=False)
        return F.cross_entropy(out.logits.float(), tokens[out.caption, out.step + 1])
