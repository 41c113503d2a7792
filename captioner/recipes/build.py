"""The parts `captioner.recipes.train.setup` wires together: the checks made before any work, then
the run's data, vocabulary, model and objective.

With a frozen encoder and `data.use_cache`, every image's grid is computed once into the feature
cache and the decoder trains from it (the five captions of an image share one stored grid);
otherwise the encoder runs on every batch (fine-tuning its last stages with `train.encoder_lr`
when `model.encoder.trainable_stages > 0`).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from captioner.config import Config, ConfigError, DataConfig
from captioner.data.boxes import Boxes, read_boxes
from captioner.data.cache import cache_dir_of
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, ImageDataset
from captioner.data.mirror import Mirrored
from captioner.data.order import EpochBatchSampler, SeededItems
from captioner.data.records import Record, fingerprint, split_records
from captioner.data.sources import load_records
from captioner.data.vocab import Vocabulary, build_vocabulary
from captioner.decoding.metrics import java_available
from captioner.deploy import require_onnx
from captioner.deploy.cache_encoder import cache_encoder
from captioner.errors import CaptionerError
from captioner.files import remove_stale_temporaries, writable_dir
from captioner.model.caption_model import CaptionModel, build_model
from captioner.model.checkpoint import Checkpoint, load_checkpoint, restore_model
from captioner.model.concepts import concept_slots
from captioner.model.encoder import Encoder
from captioner.device import autocast_dtype
from captioner.training.distributed import DistInfo, all_gather_objects, main_first
from captioner.training.boxes import BoxTargets
from captioner.training.loss import build_criterion
from captioner.training.objective import CrossEntropy, Objective
from captioner.training.scst import SelfCritical
from captioner.training.state import existing_run

log = logging.getLogger(__name__)


# --- checks before any work -------------------------------------------------------------------


def check_machine(cfg: Config, device: torch.device) -> torch.dtype | None:
    """What the machine must have for this config, and what the objective allows, checked before any
    work. Returns the autocast dtype."""
    if cfg.train.val_metric == "METEOR" and not java_available():
        raise ConfigError("config key 'train.val_metric': 'METEOR' needs Java (`java` is not on PATH); "
                          "install a JRE or choose CIDEr, Bleu_4, ROUGE_L")
    if cfg.data.cache_runtime == "onnx":
        require_onnx()
    if cfg.train.objective == "scst" and cfg.model.encoder.trainable_stages:
        raise ConfigError("config key 'model.encoder.trainable_stages': self-critical training keeps the encoder "
                          "frozen (0)")
    dtype = autocast_dtype(cfg.train.amp, device)
    log.info("precision: %s (train.amp: %s)",
             "float32" if dtype is None else f"{str(dtype).removeprefix('torch.')} autocast", cfg.train.amp)
    return dtype


def check_run_folder(out_dir: Path, dist: DistInfo, resuming: bool, overwrite: bool) -> bool:
    """The run folder is writable, and holds no other run unless `overwrite` (its files then stay until
    this run writes its first checkpoint). Returns True when it holds one to replace. Rank 0 checks."""
    if not dist.is_main:
        return False
    writable_dir(out_dir, "run folder")
    remove_stale_temporaries(out_dir)  # a checkpoint write that a kill interrupted
    earlier = None if resuming else existing_run(out_dir)
    if earlier and not overwrite:
        raise CaptionerError(f"{out_dir} holds a run ({earlier}): continue it with `captioner train --resume "
                             f"{out_dir / 'last.pt'}`, or give another --out (--overwrite replaces it once the new "
                             f"run has its first checkpoint)")
    if earlier:
        log.warning("%s holds a run (%s): it is replaced once this run writes its first checkpoint", out_dir, earlier)
    return bool(earlier)


def check_images(data: DataConfig, records: list[Record]) -> None:
    """Stop when most image files are missing (a wrong image folder), naming the first; warn when some are."""
    missing = [r.image for r in records if not Path(r.image).is_file()]
    if 2 * len(missing) > len(records):
        raise CaptionerError(f"{data.path}: {len(missing):,} of {len(records):,} images are missing (first: "
                             f"{missing[0]}); point --image-root (data.image_root) at the folder that holds them")
    if missing:
        log.warning("%d of %d images are missing and will be skipped (first: %s)", len(missing), len(records),
                    missing[0])


def check_same_data(resume: Checkpoint, train_records: list[Record], vocab: Vocabulary) -> None:
    """A resumed run trains on the data it started with: refuse (one line, saying what differs) when
    the training captions are not the same or the vocabulary would change."""
    then, now = resume.meta.get("data"), fingerprint(train_records)
    differs = isinstance(then, dict) and then.get("digest") != now["digest"]
    if not differs and resume.vocab == vocab:
        return
    parts = []
    if differs:
        parts.append(f"{then.get('images'):,} images, {then.get('captions'):,} captions then; {now['images']:,} "
                     f"images, {now['captions']:,} captions now")
    if resume.vocab != vocab:
        added = [w for w in vocab.to_list() if w not in resume.vocab][:3]
        gone = [w for w in resume.vocab.to_list() if w not in vocab][:3]
        parts.append(f"its vocabulary of {len(resume.vocab):,} words would become {len(vocab):,}, "
                     + (f"new: {', '.join(added) or '-'}; gone: {', '.join(gone) or '-'}" if added or gone
                        else "the same words in another order"))
    raise CaptionerError(f"--resume: the training data differ from the run's ({'; '.join(parts)}): resume with the "
                         f"run's data, or start a new run")


# --- data, vocabulary, model ------------------------------------------------------------------


class Splits(NamedTuple):
    train: list[Record]
    val: list[Record]  # the `train.val_images` used (0 = all)
    sizes: dict[str, int]  # images per split


def load_splits(cfg: Config) -> Splits:
    """The training and validation records, checked: neither split empty, most image files there."""
    with main_first():  # the built-in shapes set is written by rank 0 alone
        splits = split_records(load_records(cfg.data))
    if not splits["train"]:
        raise CaptionerError(f"{cfg.data.path}: no training images (the train split is empty)")
    if not splits["val"]:
        raise CaptionerError(f"{cfg.data.path}: no validation images (set data.val_fraction above 0)")
    n_val = cfg.train.val_images
    val = splits["val"][:n_val] if n_val > 0 else splits["val"]
    check_images(cfg.data, splits["train"] + val)
    return Splits(splits["train"], val, {name: len(recs) for name, recs in splits.items()})


def load_boxes(cfg: Config, train: list[Record]) -> Boxes | None:
    """The object boxes of box supervision (`train.box_weight`): `data.boxes` read (a bad file fails
    here, before any work) and matched to the training photos by file name; None = the records' own
    (the built-in shapes), or when box supervision is off. Refused when no training photo has any."""
    if not cfg.train.box_weight:
        return None
    boxes = read_boxes(cfg.data.boxes) if cfg.data.boxes else None
    boxed = sum(bool(boxes.get(Path(r.image).name) if boxes is not None else r.boxes) for r in train)
    if not boxed:
        where = f"data.boxes ({cfg.data.boxes}) names none of the {len(train):,} training photos" if boxes is not None \
            else f"{cfg.data.path} has no boxes of its own: set data.boxes to a box file of its training photos"
        raise ConfigError(f"config key 'train.box_weight': {where}")
    log.info("box supervision: %d of %d training photos have boxed objects", boxed, len(train))
    return boxes


def build_vocab(cfg: Config, train_records: list[Record], init: Checkpoint | None,
                resume: Checkpoint | None) -> Vocabulary:
    """The run's words: those of the checkpoint it starts from (`train.init`) or continues (refused when
    the model settings or the data changed), else counted on the training captions as `prepare` does."""
    counted = build_vocabulary([c for r in train_records for c in r.captions], cfg.data.min_word_count,
                               cfg.data.max_length)
    if init is not None:
        return init.vocab
    if resume is not None:
        if resume.model_config != cfg.model:
            raise CaptionerError("model.* settings cannot change when resuming (they are the checkpoint's)")
        check_same_data(resume, train_records, counted if not cfg.train.init else resume.vocab)
        return resume.vocab
    return counted


def build_run_model(cfg: Config, vocab: Vocabulary, encoder: Encoder | None, init: Checkpoint | None,
                    resume: Checkpoint | None) -> CaptionModel:
    """The checkpoint's model (`train.init` or a resume), or a new one around `encoder`, with the same
    initial weights on every rank."""
    if init is not None:
        model = restore_model(init, cfg.train.init)
    elif resume is not None:
        model = restore_model(resume)
    else:
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, len(vocab), encoder=encoder)
        if cfg.model.decoder.concepts:  # which detector output each word trains (and decoding reads)
            model.decoder.detector_slots.copy_(concept_slots(vocab, cfg.train.concept_groups))
    cfg.decode.usable_by(model.decoder.detects_words)  # validation decodes as the run's decode section says
    return model


@dataclass
class Data:
    captions: CaptionDataset  # the training captions
    train_set: Dataset  # what cross-entropy batches: `captions`, or seeded augmentation over them
    val_set: ImageDataset
    cached: bool  # inputs are grids from the feature cache (else images for the encoder)


def build_data(cfg: Config, splits: Splits, vocab: Vocabulary, encoder: Encoder, device: torch.device,
               dist: DistInfo) -> Data:
    """The training captions and validation images. With a frozen encoder and `data.use_cache`, rank 0
    fills the feature cache (and with `data.mirror` that of the mirrored training photos) and every rank
    reads grids from it; otherwise images."""
    data, tc = cfg.data, cfg.train
    if encoder.frozen and data.use_cache:
        coder = cache_encoder(encoder, device, data.cache_runtime)
        fill = partial(build_cache, cache_dir=cache_dir_of(data), batch_size=tc.batch_size, device=device,
                       num_workers=data.num_workers, progress=dist.is_main and sys.stderr.isatty())
        with main_first():  # rank 0 fills the cache; the others then find every image cached
            cache = fill(splits.train + splits.val, coder).cache
            mirror = fill(splits.train, Mirrored(coder)).cache if data.mirror else None  # the photos flipped
        captions = CaptionDataset(splits.train, vocab, data.max_length, cache=cache, mirror=mirror)
        result = Data(captions, SeededItems(captions, tc.seed) if data.mirror else captions,
                      ImageDataset(splits.val, cache=cache), True)
    else:
        captions = CaptionDataset(splits.train, vocab, data.max_length, transform=encoder.transform(train=data.augment))
        result = Data(captions, SeededItems(captions, tc.seed) if data.augment else captions,
                      ImageDataset(splits.val, transform=encoder.transform(train=False)), False)
    counts = all_gather_objects(len(captions))
    if len(set(counts)) > 1:  # DDP steps would not line up
        raise CaptionerError(f"the processes see different training sets ({counts} captions): were image files "
                             f"changing while the run started?")
    log.info("%s: %d training captions of %d images, %d validation images; vocabulary %d words; %s", data.path,
             len(captions), len(splits.train), len(result.val_set), len(vocab),
             "decoder trains from the feature cache" if result.cached else "encoder runs on every batch")
    return result


# --- the objective ----------------------------------------------------------------------------


def _ddp(net: nn.Module, device: torch.device, dist: DistInfo) -> nn.Module:
    return DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None) \
        if dist.enabled else net


def build_objective(cfg: Config, model: CaptionModel, data: Data, vocab: Vocabulary, init: Checkpoint | None,
                    device: torch.device, dist: DistInfo, amp_dtype: torch.dtype | None,
                    boxes: Boxes | None = None) -> tuple[Objective, Dataset, EpochBatchSampler]:
    """The objective `train.objective` names, what its batches are made of and their order.

    Cross-entropy batches `train.batch_size` captions (an image's together with `train.group_by_image`,
    of similar lengths with `train.group_by_length`)
    and runs the decoder on cached grids, else the whole model. Self-critical training batches images,
    each sampled `train.scst_samples` times (about `batch_size` captions a step), and runs the decoder;
    with `train.scst_kl_weight` it keeps the decoder of `init` (else of `train.init`) frozen beside it.
    With `train.box_weight`, cross-entropy also pulls object words' maps into their boxes (`boxes`,
    from `load_boxes`)."""
    tc = cfg.train
    if tc.objective == "xent":
        net = _ddp(model.decoder if data.cached else model, device, dist)
        # the detector outputs the model's words read (set from train.concept_groups when the model was new)
        slots = model.decoder.detector_slots if model.decoder.detects_words else None
        criterion = build_criterion(tc, vocab, cfg.model.encoder.name, slots)
        targets = BoxTargets.for_records(data.captions.records, boxes, vocab, model.encoder.grid,
                                         model.encoder.cells) if tc.box_weight else None
        objective = CrossEntropy(net, tc, criterion, device, amp_dtype, targets)
        sampler = EpochBatchSampler(len(data.captions), tc.batch_size, tc.seed, dist.rank, dist.world_size,
                                    groups=data.captions.image_of if tc.group_by_image else None,
                                    lengths=data.captions.lengths if tc.group_by_length else None)
        return objective, data.train_set, sampler
    captions = data.captions
    images = ImageDataset(captions.records, cache=captions.cache,
                          transform=None if data.cached else model.encoder.transform(train=False))
    initial = None
    if tc.scst_kl_weight:  # the initial model's decoder, frozen (read again from train.init on resume)
        initial = restore_model(init or load_checkpoint(tc.init), tc.init).decoder.to(device)
    objective = SelfCritical(model, _ddp(model.decoder, device, dist), images.references, vocab, tc, cfg.decode,
                             data.cached, initial, device, amp_dtype)
    sampler = EpochBatchSampler(len(images), max(1, tc.batch_size // tc.scst_samples), tc.seed, dist.rank,
                                dist.world_size)
    return objective, images, sampler
