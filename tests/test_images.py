"""load_image: every mode becomes RGB, EXIF is applied, broken files give a one-line ImageError."""
import io

import numpy as np
import pytest
from PIL import Image

from captioner.data.images import ImageError, load_image, prepare_image


def _save(im: Image.Image, path, **kw):
    im.save(path, **kw)
    return path


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "CMYK", "1", "I;16", "I", "F"])
def test_modes_become_rgb_of_the_same_size(tmp_path, mode):
    rgb = Image.new("RGB", (20, 12), (200, 30, 30))
    if mode in ("I;16", "I", "F"):
        im = Image.fromarray(np.full((12, 20), 40000 if mode != "F" else 0.5, dtype={"I;16": np.uint16,
                                                                                  "I": np.int32, "F": np.float32}[mode]))
        if mode == "I;16":
            im = im.convert("I;16") if im.mode != "I;16" else im
        path = _save(im, tmp_path / "x.tif")
    else:
        path = _save(rgb.convert(mode), tmp_path / ("x.jpg" if mode == "CMYK" else "x.png"))
    out = load_image(path)
    assert out.mode == "RGB" and out.size == (20, 12)


def test_sixteen_bit_is_rescaled_not_clipped(tmp_path):
    arr = np.array([[0, 32768, 65535]], dtype=np.uint16)
    path = _save(Image.fromarray(arr), tmp_path / "x16.png")
    assert Image.open(path).mode.startswith("I")
    px = np.asarray(load_image(path))[0, :, 0]
    assert px[0] == 0 and 120 <= px[1] <= 135 and px[2] == 255


def test_transparent_pixels_are_composited_on_white(tmp_path):
    im = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    im.putpixel((0, 0), (255, 0, 0, 255))
    out = load_image(_save(im, tmp_path / "a.png"))
    assert out.getpixel((1, 1)) == (255, 255, 255) and out.getpixel((0, 0)) == (255, 0, 0)


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (30, 10), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = load_image(_save(im, tmp_path / "r.jpg", exif=exif))
    assert out.size == (10, 30)


def test_missing_empty_text_and_truncated_files_raise_one_line_errors(tmp_path):
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    text = tmp_path / "text.jpg"
    text.write_text("not an image at all")
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buf, format="JPEG", quality=95)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    cases = {tmp_path / "missing.jpg": "not found", empty: "empty", text: "not an image", truncated: "truncated"}
    for path, reason in cases.items():
        with pytest.raises(ImageError) as e:
            load_image(path)
        message = str(e.value)
        assert message.startswith(str(path)) and reason in message and "\n" not in message


def test_decompression_bomb_guard_stays_on(tmp_path, monkeypatch):
    path = _save(Image.new("L", (100, 100)), tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 10,000 px > 2x the limit -> refused
    with pytest.raises(ImageError, match="decompression bomb"):
        load_image(path)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "I;16"])
def test_an_image_in_memory_is_treated_exactly_as_its_file(tmp_path, mode):
    """EXIF rotation, alpha and 16-bit depth: `prepare_image(Image.open(p))` equals `load_image(p)`,
    and the caller's image is left as it was."""
    rng = np.random.default_rng(0)
    if mode == "I;16":
        im = Image.fromarray(rng.integers(0, 65535, (10, 30), dtype=np.uint16))
        path, kwargs = tmp_path / "deep.png", {}
    else:
        im = Image.fromarray(rng.integers(0, 255, (10, 30, len(mode)), dtype=np.uint8), mode)
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees clockwise to display
        path, kwargs = (tmp_path / "r.png", {"exif": exif})
    im.save(path, **kwargs)
    opened = Image.open(path)
    size, mode_before = opened.size, opened.mode
    from_memory = prepare_image(opened)
    assert np.array_equal(np.asarray(from_memory), np.asarray(load_image(path))) and from_memory.mode == "RGB"
    assert opened.size == size and opened.mode == mode_before
    if mode != "I;16":
        assert from_memory.size == (10, 30)  # upright


def test_a_photo_from_a_pipe_is_read_once_from_memory(tmp_path):
    """`cat photo.jpg | captioner caption /dev/stdin`: a pipe has no size to check and cannot seek."""
    import os
    import threading

    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 10)).save(buffer, format="PNG")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(buffer.getvalue()))
    writer.start()
    image = load_image(pipe)
    writer.join()
    assert image.size == (40, 30) and image.getpixel((5, 5)) == (10, 200, 10)
    writer = threading.Thread(target=lambda: pipe.write_bytes(b""))
    writer.start()
    with pytest.raises(ImageError, match="pipe: nothing to read"):
        load_image(pipe)
    writer.join()
