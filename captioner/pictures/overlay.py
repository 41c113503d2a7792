"""One attention map over a photo: upsampled smoothly to the photo's size, placed at the cells'
receptive-field centres, coloured and blended.

Shapes: H' x W' attention grid, h x w image.
"""
from __future__ import annotations

import math

import numpy as np
import PIL.Image

from captioner.model.grid import Cells


def _cubic_weights(index: np.ndarray, n: int) -> np.ndarray:
    """(pixels,) fractional cell indices -> (pixels, n) bicubic weights over the n cells: Keys'
    cubic convolution (a = -0.75, as torch's bicubic), taps beyond the edges clamped to the edge
    cells (border padding). Each row sums to 1."""
    A = -0.75
    base = np.floor(index)
    t = (index - base)[:, None]  # (pixels, 1)
    d = np.abs(t - np.arange(-1, 3))  # (pixels, 4) distance to each of the 4 taps
    near = ((A + 2) * d - (A + 3)) * d * d + 1  # |d| <= 1
    far = ((A * d - 5 * A) * d + 8 * A) * d - 4 * A  # 1 < |d| < 2
    taps = np.where(d <= 1, near, far)  # (pixels, 4)
    cells = np.clip(base[:, None].astype(np.int64) + np.arange(-1, 3), 0, n - 1)  # (pixels, 4) clamped
    weights = np.zeros((len(index), n))
    np.add.at(weights, (np.arange(len(index))[:, None].repeat(4, 1), cells), taps)
    return weights


def upsample(attention_map: np.ndarray, size: tuple[int, int], cells: Cells | None = None) -> np.ndarray:
    """(H', W') map -> (h, w) float32 map, bicubic, clipped at 0 (bicubic overshoots).

    Each weight sits at its cell's centre (`cells`: where the cell's receptive field is centred;
    None = the nominal centre (j + 0.5) / n) and the map is interpolated smoothly between the
    centres, edges repeated beyond the outer ones (torch's `grid_sample`, bicubic, border padding,
    in numpy: drawing a picture needs no torch).

    Args:
        attention_map: (H', W') weights of one word.
        size: (w, h) target size in pixels, PIL order.
        cells: the encoder's cell geometry (`Caption.cells`).
    """
    w, h = size
    grid = np.asarray(attention_map, dtype=np.float64)  # (H', W')
    rows, cols = grid.shape

    def weights(n: int, pixels: int, origin: float, stride: float) -> np.ndarray:
        """(pixels, n): each pixel centre's fractional cell index (cell j at origin + j * stride), weighted."""
        index = ((np.arange(pixels) + 0.5) / pixels - origin) / stride if n > 1 else np.zeros(pixels)
        return _cubic_weights(index, n)

    x_cells = cells if cells is not None else Cells(0.5 / cols, 1.0 / cols)
    y_cells = cells if cells is not None else Cells(0.5 / rows, 1.0 / rows)
    up = weights(rows, h, *y_cells) @ grid @ weights(cols, w, *x_cells).T  # (h, H') (H', W') (W', w) -> (h, w)
    return np.maximum(up, 0).astype(np.float32)


def heat(weights: np.ndarray, regions: int) -> np.ndarray:
    """Attention weights per cell -> colour heat in [0, 1] on one fixed scale, the same for every word
    and every image of a model: log of the weight as a multiple of the even share 1/L, from 0 at the
    even share (or below) to 1 when all the weight is on one cell. A map spread evenly over the photo
    stays clear, a word gathered on a few cells shows strong colour; 4x the even share is 1/3 of the
    way on an 8x8 grid. (The page, captioner/serve/static/app.js, draws the same scale.)"""
    if regions <= 1:
        return np.ones_like(weights, dtype=np.float32)
    return np.clip(np.log(np.maximum(weights * regions, 1e-12)) / math.log(regions), 0.0, 1.0).astype(np.float32)


def word_focus(attention_map: np.ndarray) -> tuple[float, float]:
    """(peak, spread) of one (H', W') map: the largest weight of a cell, and the entropy over the
    cells divided by its maximum log L (0 = all on one cell, 1 = spread evenly)."""
    p = np.asarray(attention_map, dtype=np.float64).ravel()
    p = p / max(p.sum(), 1e-12)
    entropy = -float((p[p > 0] * np.log(p[p > 0])).sum())
    return float(p.max()), entropy / math.log(p.size) if p.size > 1 else 0.0


def render_attention(image: PIL.Image.Image, attention_map: np.ndarray, opacity: float = 0.6,
                     cmap: str = "jet", cells: Cells | None = None) -> PIL.Image.Image:
    """The photo with one attention map blended over it: RGB, the photo's size.

    Colours are on `heat`'s fixed scale (multiples of the even share, the same for every word), not
    stretched to each map's own maximum, so a word that looked everywhere looks faint. The colour's
    opacity follows the heat too, from 0 to `opacity`, so the photo stays readable around the hot spots.
    """
    import matplotlib

    level = heat(upsample(attention_map, image.size, cells), np.size(attention_map))  # (h, w) in [0, 1]
    colours = matplotlib.colormaps[cmap](level)[..., :3]  # (h, w, 3) in [0, 1]
    photo = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (h, w, 3)
    weight = opacity * level[..., None]  # (h, w, 1)
    blended = (1 - weight) * photo + weight * colours
    return PIL.Image.fromarray((blended * 255 + 0.5).clip(0, 255).astype(np.uint8))
