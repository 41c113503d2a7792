"""Where the *evidence* for a word is, beside where the decoder looked: gradient relevance maps.

An attention map is what the decoder read at a step; it need not be where the word's evidence is
(the grid's mean reaches every step too, and the state carries what earlier steps read). This is
the Grad-CAM family's answer instead: the gradient of the word's log-probability with respect to
each region's encoder feature, times the feature (gradient x input), summed over channels, negative
evidence cut at zero and the rest normalised to sum 1 over the regions. It is labelled
"relevance" wherever it is shown or scored; attention maps stay what the decoder really used.

Shapes: N images, B captions, T words (+ <end>), L = H'·W' regions, D encoder width.
"""
from __future__ import annotations

import dataclasses

import PIL.Image
import torch
from torch import Tensor

from captioner.decoding.caption import Caption
from captioner.decoding.captioner import Captioner
from captioner.decoding.forced import forced_steps
from captioner.model.decoder import AttentionDecoder


def relevance_maps(decoder: AttentionDecoder, features: Tensor, tokens: Tensor, lengths: Tensor,
                   rows: Tensor | None = None) -> Tensor:
    """Teacher-force the captions and return each word's gradient relevance over the regions.

    Args:
        decoder: in eval mode (dropout off).
        features: (N, L, D) encoder grids.
        tokens: (B, T + 2) `[<start>, w1..wn, <end>, <pad>...]` word ids.
        lengths: (B,) scored positions per caption (words + <end>), at least 1.
        rows: (B,) int64 row of `features` for each caption; None = caption b is image b.
    Returns:
        (B, T + 1, L) float32: for step t (predicting tokens[:, t + 1]) a map summing to 1 over the
        regions (an even map where no region has positive evidence); zeros past a caption's end.
    """
    B, device = tokens.size(0), features.device
    rows = torch.arange(B, device=device) if rows is None else rows.to(device)
    tokens, lengths = tokens.to(device, torch.long), lengths.to(device)
    steps = int(lengths.max())
    with torch.enable_grad():
        grid = features.detach().float()[rows].requires_grad_(True)  # (B, L, D): one copy per caption
        memory = decoder.memory(grid)
        logprobs, _ = forced_steps(decoder, memory, decoder.init_hidden(memory), tokens, steps)  # T + 1 x (B,)
        maps = []
        for t, logp in enumerate(logprobs):
            # captions are independent rows, so the gradient of the batch's sum is each caption's own
            (grad,) = torch.autograd.grad(logp.sum(), grid, retain_graph=t + 1 < steps)  # (B, L, D)
            maps.append((grad * grid.detach()).sum(dim=-1).clamp_min(0.0))  # (B, L)
    relevance = torch.stack(maps, dim=1)  # (B, T + 1, L)
    total = relevance.sum(dim=-1, keepdim=True)  # (B, T + 1, 1)
    even = torch.full_like(relevance, 1.0 / relevance.size(-1))
    relevance = torch.where(total > 0, relevance / total.clamp_min(1e-30), even)
    live = torch.arange(steps, device=device)[None, :] < lengths[:, None]  # (B, T + 1)
    return torch.where(live[..., None], relevance, 0.0)


def with_relevance(captioner: Captioner, image: PIL.Image.Image, caption: Caption) -> Caption:
    """`caption` of `image` with its attention maps replaced by its words' relevance maps (T, H', W'),
    the words teacher-forced on the image (the torch decoder only)."""
    if not caption.tokens:
        return caption
    features = captioner.encode([image])  # (1, L, D)
    ids = captioner.vocab.encode(caption.tokens)  # [<start>, w1..wn, <end>]
    T, (H, W) = len(caption.tokens), captioner.grid
    maps = relevance_maps(captioner.model.decoder, features, torch.tensor([ids]), torch.tensor([T + 1]))  # (1, T + 1, L)
    return dataclasses.replace(caption, attention=maps[0, :T].reshape(T, H, W).cpu().numpy())
