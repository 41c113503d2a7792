"""Does the pipeline scale? `prepare` and one `train` epoch on synthetic COCO-layout data of growing size.

    python scripts/bench_scale.py                       # 2k, 8k and 32k images
    python scripts/bench_scale.py --sizes 2000 8000 32000 64000

Each size is a folder in COCO's layout (`annotations/captions_train2014.json` + `train2014/`, and a
val file and folder with 1 image in 20), of small generated JPEGs with 5 template captions each.
The tiny `random` encoder (64 px, a 4x4 grid) encodes them, so what grows is the pipeline itself:
reading and splitting the records, the vocabulary, cache shards written and read, the data
order, the decoder's steps. Every size runs in fresh processes, `captioner prepare` then
`captioner train` for one epoch (train.val_images=100); each reports its own peak RSS.

Printed: per size, prepare images/s and seconds per 1,000 images, cache bytes per image, train
captions/s and milliseconds per 1,000 captions, peak RSS of each process; then the ratios from the
second size to the last (the targets: time per image within 15%, peak RSS within 15%). Last, an
extrapolation to COCO (123,287 images cached, 566k training captions per epoch) with the shipped coco config: its encoder's
images/s and its decoder's captions/s measured here on a few synthetic inputs of the real sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
THINGS = ["dog", "cat", "car", "bike", "ball", "tree", "boat", "bird", "horse", "kite"]
PLACES = ["on the grass", "in the water", "near a house", "on a street", "in the snow", "under a tree"]


def make_coco(folder: Path, n: int, seed: int = 0) -> None:
    """n images in COCO's layout: 95% in train2014, 5% in val2014, 5 captions each."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    splits = {"train2014": [], "val2014": []}
    for i in range(n):
        split = "val2014" if i % 20 == 0 else "train2014"
        (folder / split).mkdir(parents=True, exist_ok=True)
        colour, thing = rng.choice(COLOURS), rng.choice(THINGS)
        image = Image.new("RGB", (64, 48), tuple(rng.randrange(256) for _ in range(3)))
        ImageDraw.Draw(image).ellipse([rng.randrange(30), rng.randrange(20), 40 + rng.randrange(20), 30 + rng.randrange(15)],
                                      fill=tuple(rng.randrange(256) for _ in range(3)))
        name = f"COCO_{split}_{i:012d}.jpg"
        image.save(folder / split / name, quality=85)
        captions = [f"a {colour} {thing} {rng.choice(PLACES)}", f"the {thing} is {colour}", f"a {thing}",
                    f"there is a {colour} {thing} {rng.choice(PLACES)}", f"a photo of a {colour} {thing}"]
        splits[split].append((i, name, captions))
    (folder / "annotations").mkdir(exist_ok=True)
    for split, items in splits.items():
        data = {"images": [{"id": i, "file_name": name} for i, name, _ in items],
                "annotations": [{"id": i * 5 + k, "image_id": i, "caption": c}
                                for i, _, caps in items for k, c in enumerate(caps)]}
        (folder / "annotations" / f"captions_{split}.json").write_text(json.dumps(data))


SETTINGS = ["model.encoder.name=random", "model.encoder.image_size=64", "model.decoder.embed_dim=32",
            "model.decoder.hidden_dim=64", "model.decoder.attention_dim=32", "model.decoder.feature_dim=32",
            "train.epochs=1", "train.batch_size=64", "train.val_images=100", "train.amp=off", "train.patience=0",
            "decode.beam_size=1", "data.min_word_count=1"]


def run_measured(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a `captioner` command in a fresh process; the seconds are the
    command's own, after the imports every run pays once."""
    code = ("import resource, sys, time\n"
            "import captioner.recipes.train, captioner.recipes.prepare, pycocotools.coco\n"
            "from captioner.cli import main\n"
            "tick = time.perf_counter()\ncode = main(sys.argv[1:])\n"
            "print('SECONDS', time.perf_counter() - tick, file=sys.stderr)\n"
            "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[:2])} failed:\n{done.stderr[-3000:]}")
    found = {line.split()[0]: float(line.split()[1]) for line in done.stderr.splitlines()
             if line.startswith(("SECONDS", "PEAK_RSS_KB"))}
    return found["SECONDS"], found["PEAK_RSS_KB"] / 1024


def measure(size: int, work: Path, threads: int) -> dict[str, float]:
    data = work / f"coco-{size}"
    make_coco(data, size)
    env = {**os.environ, "CAPTIONER_CACHE": str(work / f"cache-{size}"), "OMP_NUM_THREADS": str(threads)}
    prep_s, prep_rss = run_measured(["prepare", "--data", str(data), "--device", "cpu", *SETTINGS], env)
    shards = list((work / f"cache-{size}" / "features").glob("*/shard-*.f16"))
    cache_bytes = sum(p.stat().st_size for p in shards)
    train_s, train_rss = run_measured(["train", "--data", str(data), "--out", str(work / f"run-{size}"),
                                       "--device", "cpu", *SETTINGS], env)
    line = json.loads((work / f"run-{size}" / "metrics.jsonl").read_text().splitlines()[-1])
    return {"images": size, "prepare_s": prep_s, "prepare_img_s": size / prep_s, "cache_bytes_per_image": cache_bytes / size,
            "shards": len(shards), "prepare_rss_mb": prep_rss, "train_s": train_s,
            "captions_per_s": line["captions_per_s"], "train_rss_mb": train_rss}


def coco_rates(threads: int) -> dict[str, float]:
    """The shipped coco config's encoder (images/s) and decoder (captions/s) measured on synthetic inputs."""
    import torch

    from captioner.config import load_config
    from captioner.data.datasets import CaptionItem, collate
    from captioner.model import build_model
    from captioner.training.loop import optimize
    from captioner.training.loss import build_criterion
    from captioner.training.objective import CrossEntropy
    from captioner.training.optim import build_optimizer

    torch.set_num_threads(threads)
    cfg = load_config("coco")
    model = build_model(cfg.model, 10_000)
    S, (H, W), D = cfg.model.encoder.image_size, model.encoder.grid, model.encoder.out_dim
    images = torch.randn(8, 3, S, S)
    model.encoder.infer(images[:2])
    tick = time.perf_counter()
    model.encoder.infer(images)
    encode_rate = len(images) / (time.perf_counter() - tick)
    bs = cfg.train.batch_size
    items = [CaptionItem(torch.randn(H * W, D), torch.randint(4, 10_000, (13,)), i // 5) for i in range(bs)]
    batch = collate(items)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    objective = CrossEntropy(model.decoder, cfg.train, build_criterion(cfg.train), torch.device("cpu"))
    model.decoder.train()
    step = lambda: optimize(objective.loss(batch).loss.total, optimizer, scheduler, scaler)
    step()
    tick = time.perf_counter()
    for _ in range(3):
        step()
    return {"grid": H * W, "dim": D, "encode_img_s": encode_rate, "train_captions_s": 3 * bs / (time.perf_counter() - tick)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 8000, 32000])
    p.add_argument("--threads", type=int, default=1, help="torch threads in each process (default 1)")
    p.add_argument("--work", help="folder for the generated data and runs (default: a temporary one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        rows = []
        for size in args.sizes:
            rows.append(measure(size, work, args.threads))
            r = rows[-1]
            print(f"measured {size:,} images: prepare {r['prepare_s']:.0f} s, train {r['train_s']:.0f} s", flush=True)
    print()
    print(f"{'images':>8} {'prepare img/s':>14} {'s / 1k img':>11} {'cache B/img':>12} {'shards':>7} "
          f"{'prepare RSS':>12} {'train cap/s':>12} {'ms / 1k cap':>12} {'train RSS':>10}")
    for r in rows:
        print(f"{r['images']:>8,} {r['prepare_img_s']:>14.0f} {1000 / r['prepare_img_s']:>11.2f} "
              f"{r['cache_bytes_per_image']:>12,.0f} {r['shards']:>7} {r['prepare_rss_mb']:>10.0f}MB "
              f"{r['captions_per_s']:>12.0f} {1e6 / r['captions_per_s']:>12.1f} {r['train_rss_mb']:>8.0f}MB")
    if len(rows) >= 3:
        a, b = rows[1], rows[-1]
        print(f"\nfrom {a['images']:,} to {b['images']:,} images ({b['images'] / a['images']:.0f}x the data):")
        print(f"  prepare time per image  {a['prepare_img_s'] / b['prepare_img_s']:.2f}x   peak RSS {b['prepare_rss_mb'] / a['prepare_rss_mb']:.2f}x")
        print(f"  train time per caption  {a['captions_per_s'] / b['captions_per_s']:.2f}x   peak RSS {b['train_rss_mb'] / a['train_rss_mb']:.2f}x")
    coco = coco_rates(args.threads)
    n_img, n_cap = 123_287, 113_287 * 5  # all images cached; an epoch is the train split's captions
    print(f"\nCOCO (Karpathy: 113,287 train + 10,000 val/test images) with the coco config, rates measured here "
          f"({args.threads} thread{'s' * (args.threads > 1)}, CPU):")
    print(f"  cache on disk   {n_img:,} x {coco['grid']} x {coco['dim']} x 2 B = {n_img * coco['grid'] * coco['dim'] * 2 / 1e9:.1f} GB")
    print(f"  cache build     {coco['encode_img_s']:.1f} images/s -> {n_img / coco['encode_img_s'] / 3600:.1f} h")
    print(f"  one epoch       {coco['train_captions_s']:.0f} captions/s -> {n_cap / coco['train_captions_s'] / 3600:.1f} h "
          f"(decoder steps only)")


if __name__ == "__main__":
    main()
