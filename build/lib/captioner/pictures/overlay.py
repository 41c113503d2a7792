"""One attention map over a photo: upsampled smoothly to the photo's size, placed at the cells'
receptive-field centres, coloured and blended.

Shapes: H' x W' attention grid, h x w image.
"""
from __future__ import annotations

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


def render_attention(image: PIL.Image.Image, attention_map: np.ndarray, opacity: float = 0.6,
                     cmap: str = "jet", cells: Cells | None = None) -> PIL.Image.Image:
    """The photo with one attention map blended over it: RGB, the photo's size.

    The map is scaled to [0, 1] by its own maximum, so every word shows where *its* attention peaked.
    The colour's opacity grows with the attention, from opacity/4 where the model did not look to
    `opacity` at the peak, so the photo stays readable around the hot spots.
    """
    import matplotlib

    heat = upsample(attention_map, image.size, cells)  # (h, w)
    heat = heat / max(float(heat.max()), 1e-12)
    colours = matplotlib.colormaps[cmap](heat)[..., :3]  # (h, w, 3) in [0, 1]
    photo = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (h, w, 3)
    weight = opacity * (0.25 + 0.75 * heat)[..., None]  # (h, w, 1)
    blended = (1 - weight) * photo + weight * colours
    return PIL.Image.fromarray((blended * 255 + 0.5).clip(0, 255).astype(np.uint8))
