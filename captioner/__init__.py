"""captioner: image captioning with Bahdanau attention over a pretrained CNN grid and a GRU decoder.

    from captioner import Captioner, load_checkpoint, plot_attention

    captioner = Captioner.from_checkpoint("runs/flickr8k-800/best.pt")
    caption = captioner.caption(["dog.jpg"])[0]          # .text, .attention (T, H', W')
    plot_attention(load_image("dog.jpg"), caption, "dog.png")

The package in the order data flows (each layer imports only from those before it):
config -> data -> model -> decoding -> training -> pictures -> recipes -> cli; `docs/DESIGN.md`.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# Public names, imported on first use so that `import captioner` (and `captioner --help`) stays fast.
_PUBLIC = {
    "Caption": "captioner.decoding.caption",
    "Captioner": "captioner.decoding.captioner",
    "load_checkpoint": "captioner.model.checkpoint",
    "load_image": "captioner.data.images",
    "plot_attention": "captioner.pictures.figures",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'captioner' has no attribute {name!r}")
