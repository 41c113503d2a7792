"""Training (`captioner train`), in the torchvision-references / torchtune recipe style.

    setup(cfg, out_dir, device, dist, resume) -> Run     data, vocabulary, model, optimiser, schedule
    train_one_epoch(net, criterion, optimizer, ...)      the steps of one epoch (or what is left of it)
    evaluate(model, loader, references, ...)             decode the validation images, score them
    save_last(run) / save_best(run)                      atomic checkpoints, rank 0 writes
    train(cfg, out_dir, device, resume) -> TrainResult   what the CLI calls; the same under torchrun

With a frozen encoder and `data.use_cache`, every image's grid is computed once into the feature
cache and the decoder trains from it (the five captions of an image share one stored grid);
otherwise the encoder runs on every batch (fine-tuning its last stages with `train.encoder_lr`
when `model.encoder.trainable_stages > 0`). With `train.group_by_image` (the default) an image's
captions share a batch, so its grid is encoded (or projected) once for all of them; the decoder
computes only real positions, so padding costs nothing either way.

Exact resume. `last.pt` is written at the end of every epoch and every
`train.checkpoint_every_steps` steps; it holds the optimiser, scheduler and scaler states, the
position (epoch, batches consumed, step), early-stopping state, every rank's RNG states (torch,
CUDA, Python, NumPy) and the full config. The data order is a pure function of (seed, epoch,
rank, world size) (see `captioner.distributed`), DataLoaders get their own seeded generators
(so creating one never moves the global RNG), and augmentation is seeded per (epoch, item). A
resumed run therefore continues on the very batch it stopped at, with the same random state,
and ends with the same weights as a run that was never interrupted.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

from captioner.cache import build_cache
from captioner.checkpoint import Checkpoint, CheckpointError, load_checkpoint, restore_model, save_checkpoint
from captioner.config import (
    Config,
    ConfigError,
    DataConfig,
    DecodeConfig,
    TrainConfig,
    apply_overrides,
    load_config,
    parse_config,
    to_dict,
)
from captioner.datasets import Batch, CaptionDataset, ImageDataset, collate, collate_images
from captioner.decoder import DecoderOutput
from captioner.distributed import (
    DistInfo,
    EpochBatchSampler,
    SeededItems,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    broadcast_object,
    capture_rng,
    dist_from_env,
    init_distributed,
    main_first,
    mix_seed,
    restore_rng,
    shutdown_distributed,
    steps_per_epoch,
)
from captioner.encoder import Encoder
from captioner.errors import CaptionerError
from captioner.loss import LossOutput, caption_loss
from captioner.metrics import METRIC_NAMES, caption_metrics
from captioner.model import CaptionModel, build_model
from captioner.prepare import load_data_records
from captioner.runtime import resolve_device, seed_everything
from captioner.search import decode
from captioner.sources import Record, split_records
from captioner.vocab import Vocabulary, build_vocabulary

log = logging.getLogger(__name__)

LAST, BEST, METRICS, CONFIG = "last.pt", "best.pt", "metrics.jsonl", "config.yaml"
Criterion = Callable[[DecoderOutput, Tensor], LossOutput]  # (packed output, (B, T + 1) tokens) -> loss


# --- state ------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Where the run is; everything here goes into `last.pt` as plain values."""

    epoch: int = 0  # the epoch being trained (0-based); == epochs when done
    batch: int = 0  # batches of `epoch` already consumed
    step: int = 0  # optimiser steps taken
    best: float | None = None  # best validation value of `train.val_metric`
    best_step: int = -1
    bad_validations: int = 0  # validations in a row without improvement (early stopping)
    last_val_step: int = -1


class Meter:
    """Running sums of the training loss since the last metrics line (kept on the device: no sync per step)."""

    TERMS = len(LossOutput._fields)  # total, xent, attention, entropy

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: Tensor | None = None  # (TERMS,) caption-weighted loss terms
        self.captions = self.tokens = self.steps = 0
        self.seconds = 0.0

    def add(self, loss: LossOutput, captions: int, tokens: int, seconds: float) -> None:
        values = torch.stack(list(loss)).detach().float() * captions  # (TERMS,)
        self.sums = values if self.sums is None else self.sums + values
        self.captions += captions
        self.tokens += tokens
        self.steps += 1
        self.seconds += seconds

    def totals(self) -> list[float]:
        """[the TERMS loss sums, captions, tokens, steps, seconds] as floats."""
        sums = self.sums.tolist() if self.sums is not None else [0.0] * self.TERMS
        return [*sums, float(self.captions), float(self.tokens), float(self.steps), self.seconds]

    def load(self, totals: list[float]) -> None:
        k = self.TERMS
        if len(totals) == k + 3:  # written before the entropy term existed
            totals = [*totals[: k - 1], 0.0, *totals[k - 1:]]
        self.sums = torch.tensor(totals[:k], dtype=torch.float32) if totals[k] else None
        self.captions, self.tokens, self.steps = int(totals[k]), int(totals[k + 1]), int(totals[k + 2])
        self.seconds = float(totals[k + 3])


@dataclass
class Run:
    """Everything `setup` builds; `fit` runs it."""

    cfg: Config
    out_dir: Path
    device: torch.device
    dist: DistInfo
    vocab: Vocabulary
    model: CaptionModel  # the plain model (checkpoints, decoding)
    net: nn.Module  # what the steps call: the decoder (cached features) or the model, DDP-wrapped when distributed
    cached: bool
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    train_set: Dataset
    sampler: EpochBatchSampler
    val_loader: DataLoader  # this rank's share of the validation images
    references: dict[int, list[str]]  # val image_id -> raw reference captions
    meta: dict[str, Any]  # facts for the checkpoints: data path, split sizes
    state: TrainState = field(default_factory=TrainState)
    meter: Meter = field(default_factory=Meter)
    writer: Any = None  # TensorBoard SummaryWriter when tensorboard is installed (rank 0)
    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # last validation

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.sampler.n, self.sampler.batch_size, self.dist.world_size)


@dataclass
class TrainResult:
    out_dir: Path
    last: Path
    best: Path | None
    metric: str  # train.val_metric
    best_value: float | None
    best_step: int
    epochs: int  # completed epochs
    steps: int
    stopped_early: bool
    metrics: dict[str, float]  # last validation
    history: list[dict[str, Any]]  # the metrics lines written in this session


# --- small pure pieces ------------------------------------------------------------------------


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 matrix instructions (AVX512-BF16 or AMX), where bf16 autocast pays off."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """`train.amp` -> autocast dtype (None = float32).

    "auto": bf16 on a GPU that supports it (fp16 + GradScaler on older ones). On the CPU, bf16 where
    the CPU has native bf16 instructions: there the default-size decoder's steps measured 1.5x faster
    than float32 (AVX512-BF16, scripts/bench_train.py --amp); float32 elsewhere. Very small decoders
    gain nothing (configs/shapes.yaml turns it off).
    """
    if amp == "off":
        return None
    if amp == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        if device.type != "cuda":
            raise ConfigError("train.amp=fp16 needs a CUDA device (use bf16 or off on the CPU)")
        return torch.float16
    raise ConfigError(f"train.amp={amp!r}: expected auto, bf16, fp16 or off")


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base learning rate at `step`: linear warmup, then cosine to 0 or constant."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def sampling_probability(final: float, epoch: int, epochs: int) -> float:
    """Scheduled sampling: 0 in the first epoch, rising linearly to `final` in the last."""
    if final <= 0.0 or epochs <= 1:
        return 0.0 if epochs > 1 else final
    return final * min(1.0, epoch / (epochs - 1))


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
    for key in ("alpha_reg", "entropy_reg", "label_smoothing"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"train.{key}={getattr(cfg, key)}: must not be negative")


# --- setup ------------------------------------------------------------------------------------


def load_splits(cfg: Config) -> tuple[list[Record], list[Record], dict[str, int]]:
    """Train records, the validation records used (`train.val_images` of them, 0 = all), images per split."""
    splits = split_records(load_data_records(cfg.data))
    if not splits["train"]:
        raise CaptionerError(f"{cfg.data.path}: no training images (the train split is empty)")
    if not splits["val"]:
        raise CaptionerError(f"{cfg.data.path}: no validation images (set data.val_fraction above 0)")
    n_val = cfg.train.val_images
    val = splits["val"][:n_val] if n_val > 0 else splits["val"]
    return splits["train"], val, {name: len(recs) for name, recs in splits.items()}


def build_datasets_for(data: DataConfig, seed: int, batch_size: int, encoder: Encoder, train_records: list[Record],
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


def build_criterion(cfg: TrainConfig) -> Criterion:
    """The training loss with the config's weights: packed decoder output, tokens -> LossOutput."""
    return functools.partial(caption_loss, alpha_reg=cfg.alpha_reg, label_smoothing=cfg.label_smoothing,
                             entropy_reg=cfg.entropy_reg)


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
    amp_dtype = resolve_amp(tc.amp, device)
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
    train_set, val_set, cached = build_datasets_for(cfg.data, tc.seed, tc.batch_size, model.encoder, train_records,
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
    meta = {"data": str(cfg.data.path), "splits": split_sizes, "train_captions": n_train,
            "val_images": len(val_set), "decode": to_dict(cfg.decode), "config": to_dict(cfg)}
    run = Run(cfg, out_dir, device, dist, vocab, model, net, cached, optimizer, scheduler, scaler, amp_dtype,
              train_set, sampler, val_loader, references, meta)

    if resume is not None and resume.train_state is not None:
        _restore(run, resume.train_state)
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


def _restore(run: Run, ts: dict[str, Any]) -> None:
    """Load optimiser, scheduler, scaler, position and this rank's RNG from a checkpoint's train_state."""
    run.optimizer.load_state_dict(ts["optimizer"])
    run.scheduler.load_state_dict(ts["scheduler"])
    if ts.get("scaler"):
        run.scaler.load_state_dict(ts["scaler"])
    run.state = TrainState(**ts["position"])
    order = ts["data_order"]
    now = _data_order(run)
    if order != now:
        changed = ", ".join(f"{k} {order.get(k)} -> {v}" for k, v in now.items() if order.get(k) != v)
        log.warning("the data order differs from the interrupted run's (%s): the resume is not exact%s", changed,
                    "; the interrupted epoch starts over" if run.state.batch else "")
        run.state.batch = 0  # a position in the old order means nothing in the new one
    rngs = ts["rng"]
    if len(rngs) == run.dist.world_size:
        restore_rng(rngs[run.dist.rank])
        run.meter.load(ts["meter"][run.dist.rank])
    else:
        log.warning("checkpoint has RNG states of %d processes, this run has %d: reseeding", len(rngs),
                    run.dist.world_size)
        torch.manual_seed(mix_seed(run.cfg.train.seed, run.dist.rank, run.state.step))
    if run.dist.is_main:
        _truncate_metrics(run.out_dir / METRICS, run.state.step)
    log.info("resumed at epoch %d, batch %d, step %d", run.state.epoch + 1, run.state.batch, run.state.step)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines a killed run wrote after its last checkpoint (they will be written again)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
    if len(keep) != len(lines):
        path.write_text("".join(ln + "\n" for ln in keep))


def _summary_writer(out_dir: Path) -> Any:
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out_dir / "tb"))


def train_loader(run: Run, epoch: int, start_batch: int) -> DataLoader:
    """This rank's batches of `epoch` from `start_batch` on. The loader's own generator (seeded per
    epoch) keeps the global RNG untouched when iteration starts."""
    run.sampler.set_epoch(epoch, start_batch)
    if isinstance(run.train_set, SeededItems):
        run.train_set.set_epoch(epoch)
    return DataLoader(run.train_set, batch_sampler=run.sampler, collate_fn=collate,
                      num_workers=run.cfg.data.num_workers, pin_memory=run.device.type == "cuda",
                      generator=torch.Generator().manual_seed(mix_seed(run.cfg.train.seed, epoch)))


# --- steps ------------------------------------------------------------------------------------


def train_step(net: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler, batch: Batch,
               device: torch.device, amp_dtype: torch.dtype | None = None, sampling_prob: float = 0.0,
               grad_clip: float = 0.0) -> LossOutput:
    """One optimiser step on a batch; returns the (detached) loss terms."""
    inputs = batch.inputs.to(device, non_blocking=True)  # (N, L, D) features or (N, 3, S, S) images
    tokens = batch.tokens.to(device, non_blocking=True)  # (B, T + 1)
    lengths = batch.lengths.to(device, non_blocking=True)  # (B,)
    rows = batch.rows.to(device, non_blocking=True)  # (B,) each caption's image
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        out = net(inputs, tokens, lengths, rows, sampling_prob=sampling_prob)  # packed: logits (P, V), alphas (P, L)
        loss = criterion(out, tokens)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss.total).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return LossOutput(*(t.detach() for t in loss))


def train_one_epoch(net: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                    loader: DataLoader, device: torch.device, meter: Meter, *, amp_dtype: torch.dtype | None = None,
                    sampling_prob: float = 0.0, grad_clip: float = 0.0, log_every: int = 10,
                    after_step: Callable[[LossOutput], bool] | None = None, progress: bool = True,
                    desc: str = "train") -> int:
    """Train on every batch of `loader`, adding to `meter`. `after_step(loss)` runs after each step
    (checkpoints, step validation) and ends the epoch early by returning True. Time spent in it
    is not counted as training time. Returns the number of steps taken."""
    net.train()
    steps = 0
    bar = tqdm(loader, desc=desc, unit="batch", leave=False, dynamic_ncols=True, disable=None if progress else True)
    tick = time.perf_counter()
    for batch in bar:
        loss = train_step(net, criterion, optimizer, scheduler, scaler, batch, device, amp_dtype, sampling_prob,
                          grad_clip)
        now = time.perf_counter()
        meter.add(loss, len(batch.lengths), int(batch.lengths.sum()), now - tick)
        steps += 1
        if steps % max(1, log_every) == 0 and not bar.disable:
            bar.set_postfix(loss=f"{loss.total.item():.3f}", cap_s=f"{meter.captions / max(meter.seconds, 1e-9):.0f}")
        if after_step is not None and after_step(loss):
            break
        tick = time.perf_counter()
    bar.close()
    return steps


@torch.no_grad()
def evaluate(model: CaptionModel, loader: DataLoader, references: dict[int, list[str]], vocab: Vocabulary,
             decode_cfg: DecodeConfig, device: torch.device, *, cached: bool, amp_dtype: torch.dtype | None = None,
             is_main: bool = True, meteor: bool = False) -> tuple[dict[str, float], dict[int, str]]:
    """Decode this rank's validation images, gather every rank's captions, score them on rank 0.

    Returns (metrics, captions by image_id), the same on every rank.
    """
    was_training = model.training
    model.eval()
    captions: dict[int, str] = {}
    for batch in loader:
        inputs = batch.inputs.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            features = inputs if cached else model.encode(inputs)  # (B, L, D)
            hyps = decode(model.decoder, features, decode_cfg, vocab)
        for image_id, h in zip(batch.image_ids.tolist(), hyps):
            captions[image_id] = " ".join(vocab.decode(h.tokens))
    model.train(was_training)
    merged: dict[int, str] = {}
    for part in all_gather_objects(captions):
        merged.update(part)
    metrics = None
    if is_main:
        metrics = caption_metrics({i: references[i] for i in merged}, merged, meteor=meteor)
    return broadcast_object(metrics), merged


# --- checkpoints ------------------------------------------------------------------------------


def _train_state(run: Run) -> dict[str, Any]:
    """What resuming needs. Collective: every rank must call it (RNG states are gathered)."""
    rngs = all_gather_objects(capture_rng())
    meters = all_gather_objects(run.meter.totals())
    return {
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "position": asdict(run.state),
        "meter": meters,  # per rank, like the RNG states
        "rng": rngs,
        "data_order": _data_order(run),
        "config": to_dict(run.cfg),
    }


def _data_order(run: Run) -> dict[str, int]:
    """What the data order depends on: a resume with other values cannot continue it exactly."""
    sm = run.sampler
    return {"captions": sm.n, "batch_size": sm.batch_size, "seed": sm.seed, "world_size": sm.world_size,
            "group_by_image": sm.groups is not None}


def _meta(run: Run) -> dict[str, Any]:
    st = run.state
    return {**run.meta, "epoch": st.epoch, "step": st.step, "metrics": dict(run.metrics),
            "best": {"metric": run.cfg.train.val_metric, "value": st.best, "step": st.best_step}}


def save_last(run: Run) -> Path:
    """Write `last.pt` (atomic; rank 0). Collective: call it on every rank."""
    train_state = _train_state(run)
    path = run.out_dir / LAST
    if run.dist.is_main:
        save_checkpoint(path, run.cfg.model, run.vocab, run.model.state_dict(), train_state, _meta(run))
    barrier()
    return path


def save_best(run: Run) -> Path:
    """Write `best.pt`: the model, vocabulary and metrics, no resume state (rank 0 only)."""
    path = run.out_dir / BEST
    save_checkpoint(path, run.cfg.model, run.vocab, run.model.state_dict(), None, _meta(run))
    return path


# --- validation and the loop ------------------------------------------------------------------


def validate(run: Run) -> bool:
    """Score the validation images, keep `best.pt`, write the metrics line. Returns True when
    early stopping says stop. Collective."""
    tc, st = run.cfg.train, run.state
    loss_sum, xent_sum, att_sum, ent_sum, n, tokens, _, seconds = all_reduce_sum(run.meter.totals())
    if not math.isfinite(loss_sum):
        raise CaptionerError(f"the training loss is not finite at step {st.step} (diverged): lower train.lr, "
                             f"keep train.grad_clip > 0, or resume from an earlier checkpoint")
    tick = time.perf_counter()
    metrics, captions = evaluate(run.model, run.val_loader, run.references, run.vocab, run.cfg.decode, run.device,
                                 cached=run.cached, amp_dtype=run.amp_dtype, is_main=run.dist.is_main,
                                 meteor=tc.val_metric == "METEOR")
    val_seconds = time.perf_counter() - tick
    run.metrics = metrics
    st.last_val_step = st.step
    value = metrics[tc.val_metric]
    if st.best is None or value > st.best:
        st.best, st.best_step, st.bad_validations = value, st.step, 0
        if run.dist.is_main:
            save_best(run)
    else:
        st.bad_validations += 1

    seconds /= run.dist.world_size  # ranks train side by side
    line = {
        "epoch": round(st.epoch + st.batch / run.steps_per_epoch, 4), "step": st.step,
        "loss": loss_sum / max(n, 1), "xent": xent_sum / max(n, 1), "attention": att_sum / max(n, 1),
        "entropy": ent_sum / max(n, 1),
        **{f"val_{k}": v for k, v in metrics.items()},
        "lr": run.optimizer.param_groups[0]["lr"], "seconds": round(seconds, 2), "val_seconds": round(val_seconds, 2),
        "captions_per_s": round(n / max(seconds, 1e-9), 1), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
    }
    run.history.append(line)
    run.meter.reset()
    if run.dist.is_main:
        with open(run.out_dir / METRICS, "a") as f:
            f.write(json.dumps(line) + "\n")
        if run.writer is not None:
            for k, v in line.items():
                if k not in ("epoch", "step"):
                    run.writer.add_scalar(k, v, st.step)
        star = " *" if st.best_step == st.step else ""
        log.info("epoch %.2f step %d: loss %.3f (xent %.3f)  %s %.3f%s  BLEU-4 %.3f  %.0f captions/s",
                 line["epoch"], st.step, line["loss"], line["xent"], tc.val_metric, value, star,
                 metrics.get("Bleu_4", 0.0), line["captions_per_s"])
        for image_id in sorted(captions)[:3]:
            log.info("  val %d: %s", image_id, captions[image_id])
    return tc.patience > 0 and st.bad_validations >= tc.patience


def fit(run: Run, stop_after_steps: int | None = None) -> TrainResult:
    """The training loop from wherever `run.state` stands. `stop_after_steps` ends the run (with a
    checkpoint) once that many steps are done in total: a hook for tests and smoke runs."""
    tc, st = run.cfg.train, run.state
    criterion = build_criterion(tc)
    per_epoch = run.steps_per_epoch
    stop = tc.patience > 0 and st.bad_validations >= tc.patience  # resumed after an early stop
    early = stop
    interrupted = False
    while st.epoch < tc.epochs and not stop:

        def after_step(loss: LossOutput) -> bool:
            nonlocal stop, early, interrupted
            st.step += 1
            st.batch += 1
            if tc.val_every_steps > 0 and st.step % tc.val_every_steps == 0:
                early = validate(run)
                stop = stop or early
            if stop_after_steps is not None and st.step >= stop_after_steps:
                stop = interrupted = True
            elif st.batch < per_epoch and (stop or (tc.checkpoint_every_steps > 0
                                                    and st.step % tc.checkpoint_every_steps == 0)):
                save_last(run)
            return stop

        loader = train_loader(run, st.epoch, st.batch)
        train_one_epoch(run.net, criterion, run.optimizer, run.scheduler, run.scaler, loader, run.device, run.meter,
                        amp_dtype=run.amp_dtype, sampling_prob=sampling_probability(tc.scheduled_sampling, st.epoch,
                                                                                    tc.epochs),
                        grad_clip=tc.grad_clip, log_every=tc.log_every, after_step=after_step,
                        progress=run.dist.is_main, desc=f"epoch {st.epoch + 1}/{tc.epochs}")
        if st.batch >= per_epoch:  # the epoch is complete
            st.epoch, st.batch = st.epoch + 1, 0
            if tc.val_every_steps <= 0:
                early = validate(run)
                stop = stop or early
            save_last(run)
        elif interrupted:
            save_last(run)
    if not interrupted and st.last_val_step != st.step:  # the last steps were never validated
        validate(run)
        save_last(run)
    if run.writer is not None:
        run.writer.close()
    best = run.out_dir / BEST
    return TrainResult(run.out_dir, run.out_dir / LAST, best if best.is_file() else None, tc.val_metric, st.best,
                       st.best_step, st.epoch, st.step, early, run.metrics, run.history)


# --- entry point ------------------------------------------------------------------------------


def run_config(config: str | Path | None, overrides: list[str], resume: str | Path | None = None,
               data: str | None = None) -> Config:
    """The config of a run: the YAML file with overrides, or, when resuming, the checkpoint's own
    config with the overrides (e.g. `train.epochs=30`). `data` replaces data.path."""
    if resume is not None:
        ckpt = load_checkpoint(resume)
        saved = (ckpt.train_state or {}).get("config")
        if saved is None:
            raise CheckpointError(f"{resume}: has no training state to resume from (use the run's last.pt)")
        try:
            cfg = parse_config(apply_overrides(saved, overrides))
        except ConfigError as e:
            raise ConfigError(f"{resume}: {e}") from None
    else:
        if config is None:
            raise ConfigError("give --config FILE (or --resume RUN/last.pt)")
        cfg = load_config(config, overrides)
    if data:
        cfg = replace(cfg, data=replace(cfg.data, path=data))
    return cfg


def train(cfg: Config, out_dir: str | Path, device: str | torch.device = "auto", resume: str | Path | None = None,
          *, stop_after_steps: int | None = None) -> TrainResult:
    """Train a model as `cfg` says, writing `last.pt`, `best.pt` and `metrics.jsonl` into `out_dir`.

    Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) each process trains its share of every
    batch with DDP; only rank 0 writes files. `resume` continues a run from its `last.pt` exactly
    (same data order, RNG, optimiser state); `cfg` should then come from `run_config(..., resume)`.
    On the CPU the run is deterministic for a fixed seed.
    """
    import torch.distributed as torch_dist

    dist = dist_from_env()
    owns_group = dist.enabled and not torch_dist.is_initialized()
    dev = init_distributed(dist, resolve_device(device) if isinstance(device, str) else device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if dev.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ckpt = load_checkpoint(resume) if resume is not None else None
        run = setup(cfg, Path(out_dir), dev, dist, ckpt)
        return fit(run, stop_after_steps)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if owns_group:
            shutdown_distributed()
