"""Setting a run up: data, vocabulary, model, optimiser and schedule from a config (and a checkpoint
to resume), as torchvision's references and torchtune's recipes do in their `setup`.

With a frozen encoder and `data.use_cache`, every image's grid is computed once into the feature
cache and the decoder trains from it (the five captions of an image share one stored grid);
otherwise the encoder runs on every batch (fine-tuning its last stages with `train.encoder_lr`
when `model.encoder.trainable_stages > 0`).
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset

from captioner.config import Config, ConfigError, DataConfig, TrainConfig
from captioner.data.cache import cache_dir_of
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, ImageDataset, collate_images
from captioner.data.order import EpochBatchSampler, SeededItems, steps_per_epoch
from captioner.data.records import Record, fingerprint, split_records
from captioner.data.sources import load_records
from captioner.data.vocab import Vocabulary, build_vocabulary
from captioner.decoding.metrics import java_available
from captioner.deploy import require_onnx
from captioner.deploy.encoder import cache_encoder
from captioner.errors import CaptionerError
from captioner.files import remove_stale_temporaries, writable_dir
from captioner.model.caption_model import CaptionModel, build_model
from captioner.model.checkpoint import Checkpoint, load_checkpoint, restore_model
from captioner.model.encoder import Encoder, build_encoder
from captioner.runtime import autocast_dtype, seed_everything
from captioner.training.distributed import DistInfo, all_gather_objects, main_first
from captioner.training.scst import SelfCritical
from captioner.training.state import Run, existing_run, restore

log = logging.getLogger(__name__)


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate at `step`: linear warmup, then cosine to 0 or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def load_splits(cfg: Config) -> tuple[list[Record], list[Record], dict[str, int]]:
    """Train records, the validation records used (`train.val_images` of them, 0 = all), images per split."""
    splits = split_records(load_records(cfg.data))
    if not splits["train"]:
        raise CaptionerError(f"{cfg.data.path}: no training images (the train split is empty)")
    if not splits["val"]:
        raise CaptionerError(f"{cfg.data.path}: no validation images (set data.val_fraction above 0)")
    n_val = cfg.train.val_images
    val = splits["val"][:n_val] if n_val > 0 else splits["val"]
    return splits["train"], val, {name: len(recs) for name, recs in splits.items()}


def check_images(data: DataConfig, records: list[Record]) -> None:
    """Stop when most image files are missing (a wrong image folder), naming the first; warn when some are."""
    missing = [r.image for r in records if not Path(r.image).is_file()]
    if 2 * len(missing) > len(records):
        raise CaptionerError(f"{data.path}: {len(missing):,} of {len(records):,} images are missing (first: "
                             f"{missing[0]}); point --image-root (data.image_root) at the folder that holds them")
    if missing:
        log.warning("%d of %d images are missing and will be skipped (first: %s)", len(missing), len(records),
                    missing[0])


def check_environment(cfg: Config, device: torch.device) -> torch.dtype | None:
    """What the machine must have for this config, checked before any work. Returns the autocast dtype."""
    if cfg.train.val_metric == "METEOR" and not java_available():
        raise ConfigError("config key 'train.val_metric': 'METEOR' needs Java (`java` is not on PATH); "
                          "install a JRE or choose CIDEr, Bleu_4, ROUGE_L")
    if cfg.data.cache_runtime == "onnx":
        require_onnx()
    return autocast_dtype(cfg.train.amp, device)


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


def build_datasets(data: DataConfig, seed: int, batch_size: int, encoder: Encoder, train_records: list[Record],
                   val_records: list[Record], vocab: Vocabulary, device: torch.device,
                   dist: DistInfo) -> tuple[Dataset, ImageDataset, bool]:
    """(train captions, validation images, cached?). With a frozen encoder and `data.use_cache`,
    rank 0 fills the feature cache and every rank reads grids from it; otherwise images."""
    if encoder.frozen and data.use_cache:
        with main_first():  # rank 0 fills the cache; the others then find every image cached
            cache = build_cache(train_records + val_records, cache_encoder(encoder, device, data.cache_runtime),
                                cache_dir_of(data), batch_size=batch_size,
                                device=device, num_workers=data.num_workers,
                                progress=dist.is_main and sys.stderr.isatty()).cache
        return (CaptionDataset(train_records, vocab, data.max_length, cache=cache),
                ImageDataset(val_records, cache=cache), True)
    train_set: Dataset = CaptionDataset(train_records, vocab, data.max_length,
                                        transform=encoder.transform(train=data.augment))
    if data.augment:
        train_set = SeededItems(train_set, seed)
    return train_set, ImageDataset(val_records, transform=encoder.transform(train=False)), False


def build_optimizer(model: CaptionModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam(W) over the decoder (`train.lr`) and any fine-tuned encoder stages (`train.encoder_lr`)."""
    groups = [{"params": list(model.decoder.parameters()), "lr": cfg.lr}]
    encoder_params = model.encoder.trainable_parameters()
    if encoder_params:
        groups.append({"params": encoder_params, "lr": cfg.encoder_lr})
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    params = [p for g in groups for p in g["params"]]
    # One fused kernel per step instead of ~10 elementwise passes per tensor: a decoder step on the
    # CPU spends ~8% of its time in the optimiser otherwise.
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return opt_cls(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def setup(cfg: Config, out_dir: Path, device: torch.device, dist: DistInfo | None = None,
          resume: Checkpoint | None = None, overwrite: bool = False) -> Run:
    """Build data, vocabulary, model, optimiser and schedule from `cfg`; restore `resume`'s state.

    What can be checked without data is checked first: the machine (Java for METEOR, CUDA for
    fp16), the run folder (writable; a folder holding another run is refused unless `overwrite`,
    and even then its files stay until this run writes its first checkpoint) and the encoder's
    weights. A resumed run must find the data it started with.
    """
    tc, dist = cfg.train, dist or DistInfo()
    amp_dtype = check_environment(cfg, device)
    out_dir = Path(out_dir)
    replacing = False
    if dist.is_main:
        writable_dir(out_dir, "run folder")
        remove_stale_temporaries(out_dir)  # a checkpoint write that a kill interrupted
        if resume is None and (earlier := existing_run(out_dir)):
            if not overwrite:
                raise CaptionerError(f"{out_dir} holds a run ({earlier}): continue it with `captioner train "
                                     f"--resume {out_dir / 'last.pt'}`, or give another --out (--overwrite "
                                     f"replaces it once the new run has its first checkpoint)")
            replacing = True
            log.warning("%s holds a run (%s): it is replaced once this run writes its first checkpoint", out_dir,
                        earlier)
    init = load_checkpoint(tc.init) if tc.init and resume is None else None  # the weights to start from
    if tc.objective == "scst" and cfg.model.encoder.trainable_stages:
        raise ConfigError("config key 'model.encoder.trainable_stages': self-critical training keeps the encoder "
                          "frozen (0)")
    encoder = build_encoder(cfg.model.encoder) if resume is None and init is None else None  # weights before data

    with main_first():  # the built-in shapes set is written by rank 0 alone
        train_records, val_records, split_sizes = load_splits(cfg)
    check_images(cfg.data, train_records + val_records)
    vocab = build_vocabulary([c for r in train_records for c in r.captions], cfg.data.min_word_count,
                             cfg.data.max_length)  # the same words `captioner prepare` counts
    if init is not None:  # a new run from another run's weights, in that run's vocabulary
        vocab, model = init.vocab, restore_model(init, tc.init)
    elif resume is not None:
        if resume.model_config != cfg.model:
            raise CaptionerError("model.* settings cannot change when resuming (they are the checkpoint's)")
        check_same_data(resume, train_records, vocab if not tc.init else resume.vocab)
        vocab, model = resume.vocab, restore_model(resume)
    else:
        torch.manual_seed(tc.seed)  # the same initial weights on every rank
        model = build_model(cfg.model, len(vocab), encoder=encoder)
    train_set, val_set, cached = build_datasets(cfg.data, tc.seed, tc.batch_size, model.encoder, train_records,
                                                val_records, vocab, device, dist)
    n_train = len(train_set)  # captions
    counts = all_gather_objects(n_train)
    if len(set(counts)) > 1:  # DDP steps would not line up
        raise CaptionerError(f"the processes see different training sets ({counts} captions): were image files "
                             f"changing while the run started?")
    log.info("%s: %d training captions of %d images, %d validation images; vocabulary %d words; %s",
             cfg.data.path, n_train, len(train_records), len(val_set), len(vocab),
             "decoder trains from the feature cache" if cached else "encoder runs on every batch")

    model.to(device)
    optimizer = build_optimizer(model, tc)
    captions = train_set.dataset if isinstance(train_set, SeededItems) else train_set
    per_step = max(1, tc.batch_size // tc.scst_samples) if tc.objective == "scst" else tc.batch_size
    n_items = len(captions.records) if tc.objective == "scst" else n_train  # images or captions
    total = tc.epochs * steps_per_epoch(n_items, per_step, dist.world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, tc.warmup_steps, tc.schedule))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    # the part the steps run: the decoder, or the whole model when the encoder runs on every batch
    net: nn.Module = model.decoder if cached or tc.objective == "scst" else model
    if dist.enabled:
        net = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    scst = None
    if tc.objective == "scst":  # batches of images, each sampled scst_samples times: ~batch_size captions a step
        images = ImageDataset(captions.records, cache=captions.cache, transform=None if cached else
                              model.encoder.transform(train=False))
        initial = None
        if tc.scst_kl_weight:  # the initial model's decoder, frozen (read again from train.init on resume)
            initial = restore_model(init or load_checkpoint(tc.init), tc.init).decoder.to(device)
        scst = SelfCritical(model, net, images.references, vocab, tc, cfg.decode, cached, initial)
        train_set = images
        sampler = EpochBatchSampler(len(images), max(1, tc.batch_size // tc.scst_samples), tc.seed, dist.rank,
                                    dist.world_size)
    else:
        sampler = EpochBatchSampler(n_train, tc.batch_size, tc.seed, dist.rank, dist.world_size,
                                    groups=captions.image_of if tc.group_by_image else None)
    val_share = Subset(val_set, range(dist.rank, len(val_set), dist.world_size))
    val_loader = DataLoader(val_share, batch_size=tc.batch_size, collate_fn=collate_images,
                            num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                            generator=torch.Generator().manual_seed(tc.seed))
    references = {i: list(refs) for i, refs in enumerate(val_set.references)}
    meta = {"splits": split_sizes, "train_captions": n_train, "val_images": len(val_set),
            "data": fingerprint(train_records)}
    run = Run(cfg, out_dir, device, dist, vocab, model, net, cached, optimizer, scheduler, scaler, amp_dtype,
              train_set, sampler, val_loader, references, meta, scst=scst, replacing=replacing)

    if resume is not None and resume.train_state is not None:
        restore(run, resume.train_state)
        run.metrics = dict(resume.meta.get("metrics") or {})
    else:
        seed_everything(tc.seed + dist.rank)  # dropout and scheduled sampling differ between ranks
    return run
