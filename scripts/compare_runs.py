"""Is model B better than model A beyond the noise of the validation images? A paired comparison
over one or more validation folds.

    python scripts/compare_runs.py A0.pt B0.pt [A1.pt B1.pt ...] [--bootstrap 10000]

Each pair is two checkpoints of one data split (B usually fine-tuned from A, e.g. SCST from its
cross-entropy start; either side may be an ensemble, `a.pt+b.pt`), scored on that split's validation
images with each checkpoint's own decode settings. Pairs on different folds (`data.val_fold`) pool
into one comparison over all their images.
Prints per fold and pooled: CIDEr-D of A and B (the mean of pycocoevalcap's per-image scores, as
validation computes it), B's relative gain with a paired bootstrap 95% interval (images resampled
within each fold), BLEU-4 (corpus, averaged over folds), distinct words and how sharply the words'
maps peak (the median peak weight as a multiple of an even spread; 1x = looking everywhere).

100 validation images give a CIDEr-D gain an interval about 25 points wide; 8 folds of 100, 9 wide.
Pairs on the same validation images (runs of two seeds on one fold) are resampled together.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from captioner.decoding.metrics import cider_per_image
from captioner.recipes.evaluate import evaluate_checkpoint


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+",
                   help="A B pairs: baseline then candidate, one pair per fold; a.pt+b.pt is an ensemble")
    p.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples")
    p.add_argument("--device", default="cpu")
    return p


def score(checkpoint: str, device: str) -> tuple[list[str], np.ndarray, float, float, float]:
    """Validation image paths, per-image CIDEr-D, corpus BLEU-4, distinct words and the median peak of
    the words' maps (as a multiple of an even spread) of a checkpoint, or of an ensemble `a.pt+b.pt`."""
    ev, _ = evaluate_checkpoint(checkpoint.split("+"), split="val", device=device, meteor=False)
    paths = [str(Path(c.path).resolve()) for c in ev.captions]
    cider = np.asarray(cider_per_image(ev.references, {c.path: c.text for c in ev.captions}))
    return paths, cider, ev.metrics["Bleu_4"], ev.diversity["distinct_words"], ev.focus["peak_median"]


def main(args: argparse.Namespace) -> None:
    if len(args.checkpoints) % 2:
        raise SystemExit("compare_runs.py: give checkpoints in pairs (baseline, candidate)")
    rng = np.random.default_rng(0)
    folds = []
    print(f"{'pair':<5}{'images':>7}{'CIDEr-D A':>11}{'CIDEr-D B':>11}{'gain':>8}{'95% interval':>18}"
          f"{'BLEU-4 A':>10}{'BLEU-4 B':>10}{'words A':>9}{'words B':>9}{'peak A':>8}{'peak B':>8}")
    for n, (a_path, b_path) in enumerate(zip(args.checkpoints[::2], args.checkpoints[1::2])):
        paths_a, a, *figures_a = score(a_path, args.device)
        paths_b, b, *figures_b = score(b_path, args.device)
        if paths_a != paths_b:
            raise SystemExit(f"compare_runs.py: {a_path} and {b_path} do not share their validation images")
        figures = [x for pair in zip(figures_a, figures_b) for x in pair]  # BLEU-4, words, peak: A then B
        folds.append(((tuple(paths_a), a, b), figures))
        print(_row(str(n), [folds[-1][0]], rng, args.bootstrap, figures))
    if len(folds) > 1:
        means = [float(np.mean([f[1][i] for f in folds])) for i in range(6)]
        print(_row("all", [f[0] for f in folds], rng, args.bootstrap, means))


def _row(name: str, pairs: list[tuple[tuple[str, ...], np.ndarray, np.ndarray]], rng: np.random.Generator, n: int,
         figures: list[float]) -> str:
    """One table row from (validation images, A's scores, B's scores) pairs: pooled means, relative
    gain and its paired bootstrap interval (stratified by fold), then BLEU-4, distinct words and
    median peak, A then B."""
    a = np.concatenate([x for _, x, _ in pairs])
    b = np.concatenate([y for _, _, y in pairs])
    sums_a, sums_b = np.zeros(n), np.zeros(n)
    draws: dict[tuple[str, ...], np.ndarray] = {}
    for images, x, y in pairs:  # resample images within each fold, keeping the pairs together;
        # pairs on the same images (e.g. runs of two seeds) draw the same images, as they are not independent
        if images not in draws:
            draws[images] = rng.integers(0, len(x), (n, len(x)))
        idx = draws[images]
        sums_a += x[idx].sum(1)
        sums_b += y[idx].sum(1)
    gains = sums_b / sums_a - 1
    low, high = np.percentile(gains, [2.5, 97.5])
    return (f"{name:<5}{len(a):>7}{a.mean():>11.3f}{b.mean():>11.3f}{b.mean() / a.mean() - 1:>+8.1%}"
            f"{f'[{low:+.1%}, {high:+.1%}]':>18}{figures[0]:>10.3f}{figures[1]:>10.3f}{figures[2]:>9.0f}"
            f"{figures[3]:>9.0f}{figures[4]:>7.1f}x{figures[5]:>7.1f}x")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
