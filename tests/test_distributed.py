"""Two CPU processes with gloo DDP: the ranks stay identical, share every caption exactly once per
epoch, and validate together (each decodes its share; the captions are gathered)."""
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from captioner.model.checkpoint import load_checkpoint

WORLD = 2
CONFIG = """\
data: {path: shapes, shapes_images: 40}
model:
  encoder: {name: random, image_size: 64}
  decoder: {embed_dim: 16, hidden_dim: 32, attention_dim: 16, dropout: 0.2}
train: {epochs: 2, batch_size: 8, lr: 0.005, scheduled_sampling: 0.3, amp: "off"}
decode: {beam_size: 2, max_length: 12}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, tmp: str, port: int, cache: str, overrides: list[str]) -> None:
    """One rank: record the batches its sampler yields and what validation gathered, then train."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), CAPTIONER_CACHE=cache)
    torch.set_num_threads(1)
    from captioner.data import order
    from captioner.recipes import train as recipe
    from captioner.training import loop

    seen: list[tuple[int, list[int]]] = []
    validations: list[tuple[dict, dict]] = []
    sampler_iter = order.EpochBatchSampler.__iter__
    validation_scores, fit = loop.validation_scores, recipe.fit

    def recording_iter(self):
        for batch in sampler_iter(self):
            seen.append((self.epoch, list(batch)))
            yield batch

    def recording_evaluate(*args, **kwargs):
        metrics, captions = validation_scores(*args, **kwargs)
        validations.append((metrics, captions))
        return metrics, captions

    def saving_fit(run, *args, **kwargs):
        result = fit(run, *args, **kwargs)
        torch.save({"model": run.model.state_dict(), "seen": seen, "validations": validations, "n": len(run.train_set)},
                   Path(tmp) / f"rank{rank}.pt")
        return result

    order.EpochBatchSampler.__iter__ = recording_iter
    loop.validation_scores, recipe.fit = recording_evaluate, saving_fit
    cfg = recipe.run_config(Path(tmp) / "ddp.yaml", overrides)
    recipe.train(cfg, Path(tmp) / "run", "cpu")


# Every value of every decoder option that changes which parameters exist: a parameter DDP never sees
# a gradient for stops the run at its second step ("Expected to have finished reduction ...").
@pytest.mark.parametrize("pooling, attend", [("mean", "before"), ("attention", "after"), ("none", "after")])
def test_two_gloo_ranks_agree_and_see_every_caption_once_per_epoch(tmp_path, pooling, attend):
    (tmp_path / "ddp.yaml").write_text(CONFIG)
    overrides = [f"model.decoder.init_pooling={pooling}", f"model.decoder.attend={attend}"]
    mp.start_processes(_worker, args=(str(tmp_path), _free_port(), str(tmp_path / "cache"), overrides),
                       nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    for k, v in ranks[0]["model"].items():
        assert torch.equal(v, ranks[1]["model"][k]), k
    saved = load_checkpoint(tmp_path / "run" / "last.pt").model_state
    assert all(torch.equal(saved[k], v.cpu()) for k, v in ranks[0]["model"].items())

    n = ranks[0]["n"]
    for epoch in (0, 1):
        batches = [b for r in ranks for e, b in r["seen"] if e == epoch]
        assert sorted(i for b in batches for i in b) == list(range(n))
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"])  # the same number of steps

    for (m0, c0), (m1, c1) in zip(ranks[0]["validations"], ranks[1]["validations"]):
        assert m0 == m1 and c0 == c1  # rank 0's metrics reach every rank
        assert sorted(c0) == [0, 1, 2, 3]  # the 4 validation images, decoded half on each rank
    assert len(ranks[0]["validations"]) == 2
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # written by rank 0 alone
