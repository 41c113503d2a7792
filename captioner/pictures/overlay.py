"""One attention map over a photo: upsampled smoothly to the photo's size, placed at the cells'
receptive-field centres, coloured and blended.

Shapes: H' x W' attention grid, h x w image.
"""
from __future__ import annotations

import math

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from captioner.model.encoder import Cells


def upsample(attention_map: np.ndarray, size: tuple[int, int], cells: Cells | None = None) -> np.ndarray:
    """(H', W') map -> (h, w) float32 map, bicubic, clipped at 0 (bicubic overshoots).

    Each weight sits at its cell's centre (`cells`: where the cell's receptive field is centred;
    None = the nominal centre (j + 0.5) / n) and the map is interpolated smoothly between the
    centres, edges repeated beyond the outer ones.

    Args:
        attention_map: (H', W') weights of one word.
        size: (w, h) target size in pixels, PIL order.
        cells: the encoder's cell geometry (`Caption.cells`).
    """
    w, h = size
    rows, cols = np.shape(attention_map)
    grid = torch.as_tensor(np.asarray(attention_map, dtype=np.float32))[None, None]  # (1, 1, H', W')

    def sample_at(n: int, pixels: int, origin: float, stride: float) -> torch.Tensor:
        """grid_sample's coordinates of the `pixels` pixel centres along one side: cell j is at -1 + 2j/(n-1)."""
        index = ((torch.arange(pixels) + 0.5) / pixels - origin) / stride  # (pixels,) fractional cell index
        return index * (2 / (n - 1)) - 1 if n > 1 else torch.zeros(pixels)

    x_cells = cells if cells is not None else Cells(0.5 / cols, 1.0 / cols)
    y_cells = cells if cells is not None else Cells(0.5 / rows, 1.0 / rows)
    gx = sample_at(cols, w, *x_cells)  # (w,)
    gy = sample_at(rows, h, *y_cells)  # (h,)
    where = torch.stack(torch.meshgrid(gx, gy, indexing="xy"), dim=-1)[None]  # (1, h, w, 2) as (x, y)
    up = F.grid_sample(grid, where, mode="bicubic", padding_mode="border", align_corners=True)[0, 0]  # (h, w)
    return up.clamp_min(0).numpy()  # (h, w)


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
