"""Pictures of where the model looked.

    overlay.py   one word's attention map over the photo (smooth, at the cells' true centres)
    figures.py   the photo and one panel per word (PNG), per-word PNGs, an animated GIF
"""
from captioner.pictures.figures import plot_attention
from captioner.pictures.overlay import render_attention, upsample

__all__ = ["plot_attention", "render_attention", "upsample"]
