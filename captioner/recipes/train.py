"""`captioner train`, the recipe (torchtune's shape): `setup` builds data, model, objective and
optimiser from a config (and a checkpoint to resume), `fit` runs the loop over them.

    train(cfg, out_dir, device, resume) -> TrainResult   what the CLI calls; the same under torchrun
    setup(cfg, out_dir, device, ...) -> Run              checks, then data, vocabulary, model, objective, optimiser
    fit(run) -> TrainResult                              epochs of `train_one_epoch`, validation, checkpoints
    run_config(config, overrides, resume) -> Config     the config of a new run or of a resumed one

The parts are the library's: the checks and builders in `captioner.recipes.build`, the objectives
(cross-entropy, self-critical), the steps of an epoch, validation, run state and exact resume in
`captioner.training`. With `train.group_by_image` (the default) an image's captions share a batch, so
its grid is encoded (or projected) once for all of them; the decoder computes only real positions,
so padding costs nothing either way.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from captioner.config import Config, ConfigError, ModelConfig, apply_overrides, load_config, parse_config, to_dict
from captioner.data.datasets import collate_images
from captioner.data.order import steps_per_epoch
from captioner.data.records import fingerprint
from captioner.model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from captioner.model.encoder import build_encoder
from captioner.recipes.build import (
    build_data,
    build_objective,
    build_run_model,
    build_vocab,
    check_machine,
    check_run_folder,
    load_boxes,
    load_splits,
)
from captioner.device import keep_freed_memory, resolve_device, seed_everything
from captioner.training.distributed import (
    DistInfo,
    dist_from_env,
    init_distributed,
    max_over_ranks,
    shutdown_distributed,
)
from captioner.training.loop import train_loader, train_one_epoch, validate
from captioner.training.loss import LossOutput
from captioner.training.optim import build_optimizer, build_scheduler
from captioner.training.state import BEST, LAST, Run, restore, save_last
from captioner.training.stop import StopRequest


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
    interrupted: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run at a checkpoint


def setup(cfg: Config, out_dir: Path, device: torch.device, dist: DistInfo | None = None,
          resume: Checkpoint | None = None, overwrite: bool = False) -> Run:
    """Build data, vocabulary, model, objective, optimiser and schedule from `cfg`; restore `resume`'s state.

    What can be checked without data is checked first: the machine (Java for METEOR, CUDA for
    fp16), the run folder (writable; a folder holding another run is refused unless `overwrite`,
    and even then its files stay until this run writes its first checkpoint) and the encoder's
    weights. A resumed run must find the data it started with.
    """
    tc, dist, out_dir = cfg.train, dist or DistInfo(), Path(out_dir)
    amp_dtype = check_machine(cfg, device)
    replacing = check_run_folder(out_dir, dist, resume is not None, overwrite)
    init = load_checkpoint(tc.init) if tc.init and resume is None else None  # the weights to start from
    encoder = build_encoder(cfg.model.encoder) if resume is None and init is None else None  # weights before data

    splits = load_splits(cfg)
    boxes = load_boxes(cfg, splits.train)
    vocab = build_vocab(cfg, splits.train, init, resume)
    model = build_run_model(cfg, vocab, encoder, init, resume)
    data = build_data(cfg, splits, vocab, model.encoder, device, dist)
    model.to(device)
    optimizer = build_optimizer(model, tc)
    objective, train_set, sampler = build_objective(cfg, model, data, vocab, init, device, dist, amp_dtype,
                                                       boxes)
    steps = (tc.schedule_epochs or tc.epochs) * steps_per_epoch(sampler.n, sampler.batch_size, dist.world_size)
    scheduler = build_scheduler(optimizer, tc, min(steps, tc.max_steps) if tc.max_steps > 0 else steps)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    val_loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(data.val_set, range(dist.rank, len(data.val_set), dist.world_size)),
        batch_size=tc.batch_size, collate_fn=collate_images, num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(tc.seed))
    meta = {"splits": splits.sizes, "train_captions": len(data.captions), "val_images": len(data.val_set),
            "data": fingerprint(splits.train)}
    references = {i: list(refs) for i, refs in enumerate(data.val_set.references)}
    run = Run(cfg, out_dir, device, dist, vocab, model, objective, data.cached, optimizer, scheduler, scaler,
              amp_dtype, train_set, sampler, val_loader, references, meta, replacing=replacing)
    if resume is not None and resume.train_state is not None:
        restore(run, resume.train_state)
        run.metrics = dict(resume.meta.get("metrics") or {})
    else:
        seed_everything(tc.seed + dist.rank)  # dropout and scheduled sampling differ between ranks
    return run


def fit(run: Run, stop_after_steps: int | None = None, request: StopRequest | None = None) -> TrainResult:
    """The training loop from wherever `run.state` stands. `stop_after_steps` ends the run (with a
    checkpoint) once that many steps are done in total: a hook for tests and smoke runs. A signal
    seen by `request` ends it the same way, after the step it arrived in (on every rank together)."""
    tc, st = run.cfg.train, run.state
    stopped_by: int | None = None
    stop = early = tc.patience > 0 and st.bad_validations >= tc.patience  # resumed after an early stop
    stop = stop or (tc.max_steps > 0 and st.step >= tc.max_steps)  # resumed after its last step
    interrupted = False

    def after_step(loss: LossOutput) -> bool:
        nonlocal stop, early, interrupted, stopped_by
        st.step += 1
        st.batch += 1
        if tc.val_every_steps > 0 and st.step % tc.val_every_steps == 0:
            early = validate(run)
            stop = stop or early
        stop = stop or (tc.max_steps > 0 and st.step >= tc.max_steps)
        if request is not None:  # every rank stops after the same step: the highest signal seen wins
            seen = request.signal or 0
            stopped_by = int(max_over_ranks(seen) if run.dist.enabled else seen) or None
        if stopped_by is not None or (stop_after_steps is not None and st.step >= stop_after_steps):
            stop = interrupted = True
        elif st.batch < run.steps_per_epoch and (stop or (tc.checkpoint_every_steps > 0
                                                          and st.step % tc.checkpoint_every_steps == 0)):
            save_last(run)
        return stop

    while st.epoch < tc.epochs and not stop:
        loader = train_loader(run, st.epoch, st.batch)
        run.objective.set_epoch(st.epoch)
        run.objective.net.train()
        train_one_epoch(run.objective, loader, run.optimizer, run.scheduler, run.scaler, run.meter,
                        grad_clip=tc.grad_clip, log_every=tc.log_every, after_step=after_step,
                        progress=run.dist.is_main, desc=f"epoch {st.epoch + 1}/{tc.epochs}")
        if st.batch >= run.steps_per_epoch:  # the epoch is complete
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
                       st.best_step, st.epoch, st.step, early, run.metrics, run.history, stopped_by)


def train(cfg: Config, out_dir: str | Path, device: str | torch.device = "auto", resume: str | Path | None = None,
          *, overwrite: bool = False, stop_after_steps: int | None = None) -> TrainResult:
    """Train a model as `cfg` says, writing `last.pt`, `best.pt` and `metrics.jsonl` into `out_dir`.

    Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) each process trains its share of every
    batch with DDP; only rank 0 writes files. `resume` continues a run from its `last.pt` exactly
    (same data order, RNG, optimiser state); `cfg` should then come from `run_config(..., resume)`.
    A folder holding another run is refused unless `overwrite`. Ctrl-C or SIGTERM ends the run after
    the current step with a checkpoint (`TrainResult.interrupted`). On the CPU the run is
    deterministic for a fixed seed.
    """
    import torch.distributed as torch_dist

    keep_freed_memory()  # a step's large temporaries reused, not page-faulted in anew
    dist = dist_from_env()
    owns_group = dist.enabled and not torch_dist.is_initialized()
    dev = init_distributed(dist, resolve_device(device) if isinstance(device, str) else device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if dev.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ckpt = load_checkpoint(resume) if resume is not None else None
        run = setup(cfg, Path(out_dir), dev, dist, ckpt, overwrite)
        with StopRequest() as request:
            return fit(run, stop_after_steps, request)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if owns_group:
            shutdown_distributed()


def run_config(config: str | Path | None, overrides: list[str], resume: str | Path | None = None,
               data: str | None = None) -> Config:
    """The config of a run: the YAML file with overrides, or, when resuming, the checkpoint's own
    config with the overrides (e.g. `train.epochs=30`). `data` replaces data.path."""
    if resume is not None:
        ckpt = load_checkpoint(resume)
        if ckpt.train_state is None:
            raise CheckpointError(f"{resume}: has no training state to resume from (use the run's last.pt)")
        try:
            cfg = parse_config(apply_overrides(to_dict(ckpt.config), overrides))
        except ConfigError as e:
            raise ConfigError(f"{resume}: {e}") from None
    else:
        if config is None and data is None:
            raise ConfigError("give --config FILE or NAME, --data PATH (with the default settings), or --resume "
                              "RUN/last.pt")
        cfg = load_config(config, overrides)
        if cfg.train.init:  # the model is the initial checkpoint's
            init = load_checkpoint(cfg.train.init)
            if cfg.model not in (ModelConfig(), init.model_config):
                raise ConfigError(f"model.* comes from train.init ({cfg.train.init}): leave it out of the config")
            cfg = replace(cfg, model=init.model_config)
    if data:
        cfg = replace(cfg, data=replace(cfg.data, path=data))
    return cfg
