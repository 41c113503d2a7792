"""Attention supervision from object boxes (`train.box_weight`; Liu et al. 2017, "Attention
Correctness in Neural Image Captioning"): the map of each word that names a boxed object of its
photo is pulled into that object's cells.

    BoxTargets.for_records(records, boxes, ...)   which cells each word of a training caption names
    box_attention(out, cells)                     -log of the map's mass on those cells

Words are matched to objects as the grounding score matches them (`word_objects`: "dog" names the
dog, "tennis ball" the ball) and cells as it places them (a cell belongs to a box when its
receptive-field centre lies inside; a box no centre falls in gets the cell nearest its middle).
Shapes: B captions, T tokens, P packed positions, L = H'·W' regions.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from captioner.data.boxes import GroundObject, objects_of
from captioner.data.images import ImageError, photo_size
from captioner.data.records import Record
from captioner.data.vocab import Vocabulary
from captioner.decoding.grounding import cell_centres, inside_mask, word_objects
from captioner.model.decoder import DecoderOutput
from captioner.model.grid import Cells


def object_cells(obj: GroundObject, image_size: tuple[int, int], grid: tuple[int, int], cells: Cells) -> np.ndarray:
    """(L,) bool: the cells of `grid` whose centres lie inside one of the object's boxes; for each box
    no centre falls in (a thing smaller than a cell), the cell nearest the box's middle."""
    xs, ys = cell_centres(grid, image_size, cells)  # (W',), (H',)
    mask = inside_mask(xs, ys, obj.boxes)  # (H', W')
    for x0, y0, x1, y1 in obj.boxes:
        if not inside_mask(xs, ys, [(x0, y0, x1, y1)]).any():
            mask[np.abs(ys - (y0 + y1) / 2).argmin(), np.abs(xs - (x0 + x1) / 2).argmin()] = True
    return mask.reshape(-1)


class BoxTargets:
    """The boxed objects of the training photos, as the cells each caption word should look at.

    Args:
        objects: per image_id (the training dataset's order), its objects: names and (L,) bool cells.
        vocab: reads the captions' token ids back into words.
        regions: L, the grid's cells.
    """

    def __init__(self, objects: Sequence[Sequence[tuple[GroundObject, np.ndarray]]], vocab: Vocabulary,
                 regions: int) -> None:
        self.objects, self.vocab, self.regions = objects, vocab, regions

    @classmethod
    def for_records(cls, records: Sequence[Record], boxes: Mapping[str, Sequence[GroundObject]] | None,
                    vocab: Vocabulary, grid: tuple[int, int], cells: Cells) -> BoxTargets:
        """The objects of `records` (a dataset's, in image_id order): from `boxes` by file name, or
        the records' own boxes (the built-in shapes) when None. A photo whose header cannot be read
        gets none (the dataset reports unreadable images)."""
        per_image: list[list[tuple[GroundObject, np.ndarray]]] = []
        for record in records:
            found = list(boxes.get(Path(record.image).name, ())) if boxes is not None else objects_of(record.boxes)
            try:
                size = photo_size(record.image) if found else (0, 0)
            except ImageError:
                found = []
            per_image.append([(o, object_cells(o, size, grid, cells)) for o in found])
        return cls(per_image, vocab, grid[0] * grid[1])

    def cells(self, tokens: Tensor, image_ids: Tensor) -> Tensor:
        """Which cells each word should look at.

        Args:
            tokens: (B, T) `<start> w1..wn <end> <pad>...` token ids. image_ids: (B,) their photos.
        Returns:
            (B, T - 1, L) bool: at position t (the step predicting tokens[:, t + 1]) the cells of
            the object that word names; all False where it names none.
        """
        B, T = tokens.shape
        target = torch.zeros(B, T - 1, self.regions, dtype=torch.bool)  # (B, T - 1, L)
        for b, image_id in enumerate(image_ids.tolist()):
            objects = self.objects[image_id]
            if not objects:
                continue
            ids = tokens[b, 1:].tolist()
            words = [self.vocab.word(i) for i in ids[: ids.index(self.vocab.end_id) if self.vocab.end_id in ids else None]]
            for t, named in enumerate(word_objects(words, [o for o, _ in objects])):
                if named is not None:
                    target[b, t] = torch.from_numpy(np.logical_or.reduce([objects[j][1] for j in named]))
        return target


def box_attention(out: DecoderOutput, cells: Tensor) -> Tensor:
    """Mean over the positions whose word names a boxed object of -log(the map's mass on its cells).

    Args:
        out: the packed pass: alphas (P, L), row p at caption out.caption[p], step out.step[p].
        cells: (B, T - 1, L) bool from `BoxTargets.cells`.
    """
    target = cells.to(out.alphas.device)[out.caption, out.step]  # (P, L)
    keep = target.any(dim=-1)  # (P,)
    if not bool(keep.any()):
        return out.alphas.new_zeros(()).float()
    mass = (out.alphas[keep].float() * target[keep]).sum(dim=-1)  # (P',)
    return -mass.clamp_min(1e-6).log().mean()
