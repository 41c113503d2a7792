"""Setting a run up: data, vocabulary, model, optimiser and schedule from a config (and a checkpoint
to resume), as torchvision's references and torchtune's recipes do in their `setup`.

With a frozen encoder and `data.use_cache`, every image's grid is computed once into the feature
cache and the decoder trains from it (the five captions of an image share one stored grid);
otherwise the encoder runs on every batch (fine-tuning its last stages with `train.encoder_lr`
when `model.encoder.trainable_stages > 0`).
"""
from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset

from captioner.config import Config, ConfigError, DataConfig, TrainConfig, to_dict
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, ImageDataset, collate_images
from captioner.data.order import EpochBatchSampler, SeededItems, steps_per_epoch
from captioner.data.records import Record, split_records
from captioner.data.sources import load_records
from captioner.data.vocab import Vocabulary, build_vocabulary
from captioner.decoding.metrics import METRIC_NAMES
from captioner.errors import CaptionerError
from captioner.model.caption_model import CaptionModel, build_model
from captioner.model.checkpoint import Checkpoint, restore_model
from captioner.model.encoder import Encoder
from captioner.runtime import autocast_dtype, seed_everything
from captioner.training.distributed import DistInfo, all_gather_objects, main_first
from captioner.training.state import BEST, CONFIG, LAST, METRICS, Run, restore

log = logging.getLogger(__name__)


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate at `step`: linear warmup, then cosine to 0 or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def check_train_config(cfg: TrainConfig) -> None:
    """Values the dataclass types cannot check; ConfigError (one line) names the key."""
    if cfg.optimizer not in ("adam", "adamw"):
        raise ConfigError(f"train.optimizer={cfg.optimizer!r}: expected adam or adamw")
    if cfg.schedule not in ("cosine", "constant"):
        raise ConfigError(f"train.schedule={cfg.schedule!r}: expected cosine or constant")
    if cfg.val_metric not in METRIC_NAMES:
        raise ConfigError(f"train.val_metric={cfg.val_metric!r}: expected one of {', '.join(METRIC_NAMES)}")
    for key in ("epochs", "batch_size"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"train.{key}={getattr(cfg, key)}: must be at least 1")
    if not 0.0 <= cfg.scheduled_sampling <= 1.0:
        raise ConfigError(f"train.scheduled_sampling={cfg.scheduled_sampling}: must be in [0, 1]")
    for key in ("coverage_weight", "entropy_weight", "label_smoothing"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"train.{key}={getattr(cfg, key)}: must not be negative")


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


def build_datasets(data: DataConfig, seed: int, batch_size: int, encoder: Encoder, train_records: list[Record],
                   val_records: list[Record], vocab: Vocabulary, out_dir: Path, device: torch.device,
                   dist: DistInfo) -> tuple[Dataset, ImageDataset, bool]:
    """(train captions, validation images, cached?). With a frozen encoder and `data.use_cache`,
    rank 0 fills the feature cache and every rank reads grids from it; otherwise images."""
    if encoder.frozen and data.use_cache:
        cache_dir = Path(data.cache_dir).expanduser() if data.cache_dir else out_dir / "cache"
        with main_first():  # rank 0 fills the cache; the others then find every image cached
            cache = build_cache(train_records + val_records, encoder, cache_dir, batch_size=batch_size,
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
          resume: Checkpoint | None = None) -> Run:
    """Build data, vocabulary, model, optimiser and schedule from `cfg`; restore `resume`'s state."""
    tc, dist = cfg.train, dist or DistInfo()
    check_train_config(tc)
    amp_dtype = autocast_dtype(tc.amp, device)
    out_dir = Path(out_dir)
    if dist.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in out_dir.glob(".*.pt.*.tmp"):  # a checkpoint write that a kill interrupted
            stale.unlink(missing_ok=True)

    with main_first():  # the built-in shapes set is written by rank 0 alone
        train_records, val_records, split_sizes = load_splits(cfg)
    if resume is not None:
        if resume.model_config != cfg.model:
            raise CaptionerError("model.* settings cannot change when resuming (they are the checkpoint's)")
        vocab, model = resume.vocab, restore_model(resume)
    else:
        vocab = build_vocabulary([c for r in train_records for c in r.captions], cfg.data.min_word_count,
                                 cfg.data.max_length)  # the same words `captioner prepare` counts
        torch.manual_seed(tc.seed)  # the same initial weights on every rank
        model = build_model(cfg.model, len(vocab))
    train_set, val_set, cached = build_datasets(cfg.data, tc.seed, tc.batch_size, model.encoder, train_records,
                                                val_records, vocab, out_dir, device, dist)
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
    total = tc.epochs * steps_per_epoch(n_train, tc.batch_size, dist.world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, tc.warmup_steps, tc.schedule))
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    net: nn.Module = model.decoder if cached else model  # the part the steps run
    if dist.enabled:
        net = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    captions = train_set.dataset if isinstance(train_set, SeededItems) else train_set
    sampler = EpochBatchSampler(n_train, tc.batch_size, tc.seed, dist.rank, dist.world_size,
                                groups=captions.image_of if tc.group_by_image else None)
    val_share = Subset(val_set, range(dist.rank, len(val_set), dist.world_size))
    val_loader = DataLoader(val_share, batch_size=tc.batch_size, collate_fn=collate_images,
                            num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                            generator=torch.Generator().manual_seed(tc.seed))
    references = {i: list(refs) for i, refs in enumerate(val_set.references)}
    meta = {"splits": split_sizes, "train_captions": n_train, "val_images": len(val_set)}
    run = Run(cfg, out_dir, device, dist, vocab, model, net, cached, optimizer, scheduler, scaler, amp_dtype,
              train_set, sampler, val_loader, references, meta)

    if resume is not None and resume.train_state is not None:
        restore(run, resume.train_state)
        run.metrics = dict(resume.meta.get("metrics") or {})
    else:
        seed_everything(tc.seed + dist.rank)  # dropout and scheduled sampling differ between ranks
        if dist.is_main:
            if (out_dir / LAST).exists():
                log.warning("%s holds an earlier run: starting a new one over it (--resume %s continues it)",
                            out_dir, out_dir / LAST)
            for name in (METRICS, BEST):  # this run's own, not an earlier run's
                (out_dir / name).unlink(missing_ok=True)
    if dist.is_main:
        (out_dir / CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        run.writer = _summary_writer(out_dir)
    return run


def _summary_writer(out_dir: Path) -> Any:
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out_dir / "tb"))
