"""Pictures of where the model looked: one panel per word, per-word PNGs, an animated GIF.

Each word's (H', W') attention map is drawn over the photo by `captioner.pictures.overlay`. Matplotlib is imported inside the functions and used
through its object API with the Agg canvas, so no global backend is set and nothing opens a window.

Shapes: T words, H' x W' attention grid, h x w displayed image.
"""
from __future__ import annotations

import math
import re
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import PIL.Image
from PIL import ImageDraw, ImageFont

from captioner.data.boxes import GroundObject
from captioner.decoding.grounding import Look, look, word_objects
from captioner.files import atomic_open
from captioner.pictures.overlay import render_attention, word_focus

if TYPE_CHECKING:  # torch's Caption and the ONNX runtime's both draw: no torch import to draw a picture
    from captioner.decoding.captioner import Caption

PANEL_INCHES = 2.4  # width of one panel
DPI = 100
DISPLAY_SIDE = 360  # longest side, pixels, of the photo inside a panel / frame
FRAME_SIDE = 448  # longest side of per-word PNGs and GIF frames


def _display_copy(image: PIL.Image.Image, side: int) -> PIL.Image.Image:
    """A copy whose longest side is `side` (big photos shrink; small ones grow, for legible panels)."""
    w, h = image.size
    scale = side / max(w, h)
    return image.convert("RGB").resize((max(1, round(w * scale)), max(1, round(h * scale))), PIL.Image.BICUBIC)


def grid_shape(n_panels: int) -> tuple[int, int]:
    """(rows, cols) for n panels: cols = ceil(sqrt(n)), as square as the count allows."""
    cols = max(1, math.ceil(math.sqrt(n_panels)))
    return math.ceil(n_panels / cols), cols


def plot_attention(image: PIL.Image.Image, caption: Caption, path: str | Path, *, per_word_dir: str | Path | None = None,
                   gif_path: str | Path | None = None, opacity: float = 0.6, cmap: str = "jet", dpi: int = DPI,
                   frame_ms: int = 900, objects: list[GroundObject] | None = None, relevance: bool = False) -> Path:
    """Draw the photo, then one panel per word with its attention over the photo; save a PNG.

    Args:
        image: the captioned image (any size; shown with its aspect ratio).
        caption: a Caption whose `attention` is (T, H', W').
        path: the PNG to write (folders are created).
        per_word_dir: also write one PNG per word there, `NN_word.png`.
        gif_path: also write an animated GIF: the photo, then one frame per word.
        opacity: opacity of the colormap over the photo.
        cmap: a matplotlib colormap name.
        dpi: resolution of the grid PNG.
        frame_ms: how long each GIF frame shows.
        objects: the photo's boxed objects: a word naming one gets its boxes outlined on its panel,
            green when the map's peak falls in one (the pointing game's hit), red when not.
        relevance: the caption's maps are gradient relevance (`with_relevance`), so labelled.
    Returns:
        The path of the grid PNG.
    """
    fig = attention_figure(image, caption, opacity, cmap, dpi, objects, relevance)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi, facecolor="white")
    if per_word_dir is not None or gif_path is not None:
        frames = word_frames(image, caption, opacity, cmap)
        if per_word_dir is not None:
            save_per_word(frames[1:], caption.tokens, per_word_dir)
        if gif_path is not None:
            save_gif(frames, gif_path, frame_ms)
    return path


def word_looks(caption: Caption, objects: list[GroundObject] | None) -> dict[int, tuple[Look, list]]:
    """Word index -> (its pointing-game Look, the boxes of the object(s) it names), for the words
    that name one of `objects`."""
    found = {}
    for t, named in enumerate(word_objects(caption.tokens, objects or [])):
        if named is not None:
            boxes = [b for j in named for b in objects[j].boxes]
            found[t] = (look(caption.attention[t], caption.tokens[t], boxes, caption.image_size, caption.cells), boxes)
    return found


def _draw_boxes(ax, found: tuple[Look, list], scale: float, cells_centre: tuple[float, float]) -> None:
    """Outline a word's boxes (green: its peak is in one, red: not) and mark the peak cell's centre."""
    from matplotlib.patches import Rectangle

    hit, boxes = found[0].hit, found[1]
    colour = "lime" if hit else "red"
    for x0, y0, x1, y1 in boxes:
        ax.add_patch(Rectangle((x0 * scale, y0 * scale), (x1 - x0) * scale, (y1 - y0) * scale, fill=False,
                               edgecolor=colour, linewidth=2))
    ax.plot(*cells_centre, marker="+", color="white", markersize=12, markeredgewidth=2.5)
    ax.plot(*cells_centre, marker="+", color=colour, markersize=10, markeredgewidth=1.5)


def attention_figure(image: PIL.Image.Image, caption: Caption, opacity: float = 0.6, cmap: str = "jet",
                     dpi: int = DPI, objects: list[GroundObject] | None = None, relevance: bool = False):
    """The figure `plot_attention` saves (a matplotlib Figure on the Agg canvas): the caption, the
    photo, one panel per word with its map and peak weight, and the colour scale they share; with
    `objects`, each object word's boxes, green for a hit and red for a miss. `relevance`: the maps
    are gradient relevance, and the heading says so."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    T = len(caption.tokens)
    if caption.attention.shape[0] != T:
        raise ValueError(f"caption has {T} words but {caption.attention.shape[0]} attention maps")
    photo = _display_copy(image, DISPLAY_SIDE)
    w, h = photo.size
    rows, cols = grid_shape(T + 1)
    title_in = 0.3  # room above each panel for its word
    panel_h = PANEL_INCHES * h / w
    text = caption.text if caption.finished else caption.text + " ..."
    if caption.word_logprobs is not None:  # words given, not searched (`caption(text=)`); each word's log p on its panel
        text = f"given: {caption.text}   (log p {caption.logprob:.2f})"
    if relevance:
        text += "  [gradient relevance: where each word's evidence is, not the decoder's attention]"
    wrapped = textwrap.fill(text, width=max(28, int(cols * PANEL_INCHES * 8)))  # ~8 characters per inch at 13 pt
    header_in = 0.2 + 0.26 * (wrapped.count("\n") + 1)  # the caption over the whole grid
    scale_in = 0.75  # the colour scale under the panels
    fig_w, fig_h = cols * PANEL_INCHES + 0.2, rows * (panel_h + title_in) + header_in + scale_in + 0.1
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    fig.text(0.5, 1 - 0.12 / fig_h, wrapped, ha="center", va="top", fontsize=13, weight="bold", linespacing=1.3)
    _draw_scale(fig, cmap, (0.2 / fig_h, 0.16 / fig_h), caption.attention[0].size)
    fig.subplots_adjust(left=0.1 / fig_w, right=1 - 0.1 / fig_w, bottom=(scale_in + 0.1) / fig_h,
                        top=1 - (header_in + title_in) / fig_h, wspace=0.04,
                        hspace=title_in / panel_h)
    logprobs = caption.word_logprobs or [None] * T
    found = word_looks(caption, objects)
    scale = w / caption.image_size[0]
    panels = [(photo, "(image)", None, None)] + [
        (render_attention(photo, caption.attention[t], opacity, cmap, caption.cells), word,
         word_focus(caption.attention[t]), logprobs[t]) for t, word in enumerate(caption.tokens)]
    for i in range(rows * cols):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.set_axis_off()
        if i < len(panels):
            picture, label, focus, logprob = panels[i]
            ax.imshow(np.asarray(picture), interpolation="bilinear")
            ax.set_title(label, fontsize=12, pad=3, color="dimgray" if i == 0 else "black")
            if i - 1 in found:
                _draw_boxes(ax, found[i - 1], scale, _peak_centre(caption, i - 1, (w, h)))
                ax.set_title(f"{label} ({'hit' if found[i - 1][0].hit else 'miss'})", fontsize=12, pad=3,
                             color="green" if found[i - 1][0].hit else "red")
            if focus is not None:
                note = f"peak {focus[0]:.2f}" + (f"   log p {logprob:.2f}" if logprob is not None else "")
                ax.text(0.02, 0.03, note, transform=ax.transAxes, fontsize=8, va="bottom",
                        bbox={"facecolor": "white", "alpha": 0.75, "pad": 1.5, "linewidth": 0})
    return fig


def _peak_centre(caption: Caption, t: int, size: tuple[int, int]) -> tuple[float, float]:
    """(x, y) in a picture of `size` of the receptive-field centre of word t's peak cell."""
    from captioner.decoding.grounding import cell_centres

    xs, ys = cell_centres(caption.attention[t].shape, size, caption.cells)
    r, c = np.unravel_index(int(np.argmax(caption.attention[t])), caption.attention[t].shape)
    return float(xs[c]), float(ys[r])


def _draw_scale(fig, cmap: str, bottom_and_height: tuple[float, float], regions: int) -> None:
    """The colour scale every panel shares (`heat`): a cell's weight as a multiple of the even share."""
    bottom, height = bottom_and_height
    ax = fig.add_axes((0.2, bottom, 0.6, height))
    ax.imshow(np.linspace(0, 1, 256)[None, :], aspect="auto", cmap=cmap, extent=(0, 1, 0, 1))
    ax.set_yticks([])
    multiples = [m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if m * 2 <= regions] + [regions]
    ticks = [math.log(m) / math.log(regions) for m in multiples] if regions > 1 else [1.0]
    ax.set_xticks(ticks, [f"{m}x" for m in multiples[:-1]] + ["all"])
    ax.tick_params(labelsize=8, length=2, pad=1)
    ax.set_title(f"a cell's weight, as a multiple of an even spread (1/{regions}); one scale for every word",
                 fontsize=8, pad=2)


# --- per-word frames (PIL) ------------------------------------------------------------------


@lru_cache(maxsize=4)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """DejaVu Sans (ships with matplotlib), else Pillow's default font."""
    try:
        from matplotlib import font_manager

        return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)
    except (ImportError, OSError, ValueError):  # pragma: no cover - matplotlib ships the font
        return ImageFont.load_default(size=size)


def _with_banner(picture: PIL.Image.Image, words: list[str], current: int | None,
                 note: str = "") -> PIL.Image.Image:
    """The picture above a white strip with the caption, the current word large (with `note`) and in colour."""
    w, h = picture.size
    font = _font(max(14, w // 22))
    big = _font(max(20, w // 12))
    lines, line, line_w, space = [], [], 0, font.getlength(" ")
    for i, word in enumerate(words):  # wrap the caption to the width
        ww = font.getlength(word)
        if line and line_w + space + ww > w - 16:
            lines.append(line)
            line, line_w = [], 0
        line.append(i)
        line_w += ww + (space if len(line) > 1 else 0)
    if line:
        lines.append(line)
    line_h = font.size + 6
    word_h = big.size + 12 if current is not None else 0
    canvas = PIL.Image.new("RGB", (w, h + word_h + line_h * len(lines) + 10), "white")
    canvas.paste(picture, (0, 0))
    draw = ImageDraw.Draw(canvas)
    if current is not None:  # the word itself, large
        draw.text((w / 2, h + 6), words[current], fill=(20, 20, 20), font=big, anchor="mt")
        if note:
            draw.text((w - 8, h + 6 + big.size // 2), note, fill=(90, 90, 90), font=font, anchor="rm")
    y = h + word_h + 4
    for row in lines:
        x = (w - sum(font.getlength(words[i]) for i in row) - space * (len(row) - 1)) / 2
        for i in row:
            colour = (200, 30, 30) if i == current else (120, 120, 120) if current is not None else (20, 20, 20)
            draw.text((x, y), words[i], fill=colour, font=font)
            x += font.getlength(words[i]) + space
        y += line_h
    return canvas


def word_frames(image: PIL.Image.Image, caption: Caption, opacity: float = 0.6, cmap: str = "jet") -> list[PIL.Image.Image]:
    """[the photo with the caption, then one overlay per word with the word (and its peak weight) under it],
    all on one colour scale (`full_scale`)."""
    photo = _display_copy(image, FRAME_SIDE)
    words = list(caption.tokens)
    frames = [_with_banner(photo, words, None)]
    for t in range(len(words)):
        overlay = render_attention(photo, caption.attention[t], opacity, cmap, caption.cells)
        frames.append(_with_banner(overlay, words, t, f"peak {word_focus(caption.attention[t])[0]:.2f}"))
    return frames


def _safe(word: str) -> str:
    return re.sub(r"[^\w.-]+", "_", word)[:40] or "word"


def save_per_word(frames: list[PIL.Image.Image], words: list[str], folder: str | Path) -> list[Path]:
    """One PNG per word, `NN_word.png`, in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for t, (frame, word) in enumerate(zip(frames, words)):
        paths.append(folder / f"{t + 1:02d}_{_safe(word)}.png")
        with atomic_open(paths[-1], "wb") as f:
            frame.save(f, format="PNG")
    return paths


def save_gif(frames: list[PIL.Image.Image], path: str | Path, frame_ms: int = 900) -> Path:
    """An endlessly looping GIF; the first frame (the plain photo) and the last one stay a little longer."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = (max(f.width for f in frames), max(f.height for f in frames))  # banners may differ in height
    padded = []
    for f in frames:
        canvas = PIL.Image.new("RGB", size, "white")
        canvas.paste(f, (0, 0))
        padded.append(canvas)
    durations = [frame_ms * 2] + [frame_ms] * (len(padded) - 2) + [frame_ms * 2] if len(padded) > 1 else [frame_ms]
    with atomic_open(path, "wb") as f:
        padded[0].save(f, format="GIF", save_all=True, append_images=padded[1:], duration=durations, loop=0,
                       optimize=False)
    return path
