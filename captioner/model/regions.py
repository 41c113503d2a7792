"""A linear map of every region of an encoder grid, cheaper on a two-scale grid.

Shapes: N images, L = H'·W' regions in row-major order, D_in region width, O outputs.

A two-scale grid (`model.encoder.two_scale`) gives each cell its own channels followed by the last
stage's, nearest-upsampled: those `block_dim` trailing channels are the same in the four cells of each
2x2 block. Their product is then computed once per block and added to each of its cells: at 16x16
cells of 120 + 1280 channels, 30% of the multiplications, the same numbers up to rounding.
"""
from __future__ import annotations

from torch import Tensor, nn


class RegionLinear(nn.Linear):
    """`nn.Linear` over the regions of a grid, (N, L, D_in) -> (N, L, O), the trailing `block_dim` channels
    multiplied once per 2x2 block (`grid_linear`); the same weights and state-dict keys as `nn.Linear`."""

    def __init__(self, in_features: int, out_features: int, grid: tuple[int, int] | None = None,
                 block_dim: int = 0) -> None:
        """
        Args:
            in_features, out_features: D_in, O.
            grid: (H', W'), both even where block_dim > 0.
            block_dim: the trailing channels each 2x2 block of cells shares (`Encoder.block_dim`); 0 = none.
        """
        super().__init__(in_features, out_features)
        if block_dim and (grid is None or grid[0] % 2 or grid[1] % 2):
            raise ValueError(f"2x2 blocks of cells need an even grid, got {grid}")
        if not 0 <= block_dim < in_features:
            raise ValueError(f"block_dim {block_dim} must be in [0, {in_features})")
        self.grid = grid
        self.block_dim = block_dim

    def forward(self, features: Tensor, outputs: Tensor | None = None) -> Tensor:
        """(N, L, D_in) -> (N, L, O), or (N, L, K) of the K outputs `outputs` (K,) int64 names.

        The per-cell product where a gradient must reach each cell's own copy of the shared channels
        (relevance maps differentiate by the grid) or where nothing is shared."""
        weight, bias = (self.weight, self.bias) if outputs is None else (self.weight[outputs], self.bias[outputs])
        if not self.block_dim or features.requires_grad:
            return nn.functional.linear(features, weight, bias)
        return grid_linear(features, weight, bias, self.grid, self.block_dim)


def grid_linear(features: Tensor, weight: Tensor, bias: Tensor | None, grid: tuple[int, int], block_dim: int) -> Tensor:
    """`nn.functional.linear(features, weight, bias)` over a grid whose last `block_dim` channels are the
    same in the four cells of each 2x2 block, those multiplied once per block.

    Args:
        features: (N, L, D_in), L = H'·W' in row-major order, H' and W' even.
        weight: (O, D_in); bias: (O,) or None.
        grid: (H', W').
        block_dim: the trailing channels each block shares, 0 < block_dim < D_in; read from each block's
            first cell.
    Returns:
        (N, L, O).
    """
    N, L, D_in = features.shape
    H, W = grid[0] // 2, grid[1] // 2
    own = D_in - block_dim
    blocks = features.reshape(N, H, 2, W, 2, D_in)[:, :, 0, :, 0, own:]  # (N, H, W, block_dim)
    shared = nn.functional.linear(blocks, weight[:, own:])  # (N, H, W, O)
    cells = nn.functional.linear(features[..., :own], weight[:, :own], bias)  # (N, L, O)
    O = cells.size(-1)
    out = cells.view(N, H, 2, W, 2, O) + shared[:, :, None, :, None]  # (N, H, 2, W, 2, O)
    return out.view(N, L, O)
