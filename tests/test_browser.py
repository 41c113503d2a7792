"""The page in a real browser: `captioner serve` as a user starts it, headless Chromium through
Playwright (Debian's `chromium`; .ci/run installs it when missing). Skips, with the reason, only
when no browser can be had."""
import math
import os
import shutil

import numpy as np
import pytest

from servers import Server, sharp_checkpoint

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
CHROMIUM = os.environ.get("CAPTIONER_CHROMIUM") or next(
    (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install -y chromium)")]
EXAMPLE = "captioner/serve/static/examples/two-shapes.png"

OVERLAY_ALPHA = """() => {
  const c = document.getElementById("overlay");
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const alpha = new Array(c.width * c.height);
  for (let i = 0; i < alpha.length; i++) alpha[i] = d[i * 4 + 3];
  return { width: c.width, height: c.height, alpha };
}"""


def _overlay(page) -> np.ndarray:
    """The overlay canvas's alpha channel, (h, w): the colour's opacity follows the attention."""
    got = page.evaluate(OVERLAY_ALPHA)
    return np.asarray(got["alpha"], dtype=np.float64).reshape(got["height"], got["width"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(sharp_checkpoint(tmp_path_factory.mktemp("browser") / "sharp.pt"))
    yield server
    assert server.stop() == 0  # Ctrl-C stops it cleanly


@pytest.fixture
def page(server):
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url)
        page.wait_for_selector("#examples button")  # /api/model answered
        yield page
        browser.close()
        assert errors == []


def _caption(page, path=EXAMPLE) -> dict:
    with page.expect_response(lambda r: "/api/caption" in r.url) as answer:
        page.set_input_files("#file", path)
    page.wait_for_selector(".word")
    return answer.value.json()


def _assert_peaks_where_the_map_does(overlay: np.ndarray, attention: list, cells: dict) -> None:
    """Where the overlay is strongest is where the word's map peaks, at that cell's receptive-field
    centre (origin + j * stride of the image side), within half a cell."""
    attention = np.asarray(attention)
    row, col = np.unravel_index(attention.argmax(), attention.shape)
    h, w = overlay.shape
    y, x = np.unravel_index(overlay.argmax(), overlay.shape)
    expect_x, expect_y = (cells["origin"] + col * cells["stride"]) * w, (cells["origin"] + row * cells["stride"]) * h
    assert math.hypot(x - expect_x, y - expect_y) <= 0.5 * cells["stride"] * max(w, h)


def test_hovering_a_word_draws_its_map_brightest_where_it_peaks(page, tmp_path):
    result = _caption(page)
    chips = page.locator(".word")
    assert chips.count() == len(result["tokens"]) >= 2
    assert page.locator("#status").inner_text().startswith(f"“{result['caption']}”")
    before = _overlay(page)
    assert before.max() == 0  # no word chosen: nothing drawn over the photo

    chips.nth(1).hover()
    after = _overlay(page)
    page.screenshot(path=str(tmp_path / "page.png"))
    assert after.max() > 100  # the overlay changed: a sharp map shows strong colour
    _assert_peaks_where_the_map_does(after, result["attention"][1], result["cells"])
    label = page.get_attribute("#overlay", "aria-label")
    assert label.startswith(f'"{result["tokens"][1]}": peak weight')  # a text alternative for the map


def test_the_keyboard_alone_steps_through_the_words(page):
    result = _caption(page)
    page.locator(".word").first.focus()
    first = _overlay(page)
    page.keyboard.press("ArrowRight")
    assert page.get_attribute(".word >> nth=1", "aria-pressed") == "true"
    second = _overlay(page)
    maps = np.asarray(result["attention"])
    if not np.allclose(maps[0], maps[1], atol=1e-3):
        assert not np.array_equal(first, second)
    page.keyboard.press("End")
    assert page.get_attribute(f".word >> nth={len(result['tokens']) - 1}", "aria-pressed") == "true"


def test_the_overlay_follows_the_photo_when_the_window_resizes(page):
    _caption(page)
    page.locator(".word").nth(1).hover()
    wide = page.evaluate("() => document.getElementById('overlay').width")
    page.set_viewport_size({"width": 390, "height": 800})  # a phone
    page.wait_for_function(f"() => document.getElementById('overlay').width < {wide}")
    box, photo = page.locator("#overlay").bounding_box(), page.locator("#photo").bounding_box()
    assert box == pytest.approx(photo, abs=1.0) and box["width"] <= 390


def test_a_file_that_is_not_an_image_shows_the_servers_sentence(page, tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    page.set_input_files("#file", str(bad))
    page.wait_for_selector("#status.error")
    assert page.locator("#status").inner_text() == "upload: not an image (format not recognised)"


def _score(page, text: str):
    """Type `text` into the box and press Enter: the answer to the request it sends."""
    page.fill("#text", text)
    with page.expect_response(lambda r: "/api/caption" in r.url) as answer:
        page.press("#text", "Enter")
    return answer.value


def test_a_typed_caption_shows_each_words_map_and_log_probability(page):
    searched = _caption(page)
    answer = _score(page, "a red circle above a blue square")
    result = answer.json()
    assert answer.ok and result["tokens"] == "a red circle above a blue square".split()
    page.wait_for_selector("#status:has-text('Your words')")
    chips = page.locator(".word")
    assert chips.count() == len(result["tokens"])
    for t, (word, logprob) in enumerate(zip(result["tokens"], result["word_logprobs"])):
        assert chips.nth(t).inner_text().startswith(word)
        assert chips.nth(t).locator("small").inner_text() == f"{logprob:.2f}"
        assert chips.nth(t).get_attribute("aria-label").endswith(f"log-probability {logprob:.2f}")
    sharpest = int(np.argmax([f["peak"] for f in result["focus"]]))
    chips.nth(sharpest).hover()
    _assert_peaks_where_the_map_does(_overlay(page), result["attention"][sharpest], result["cells"])
    assert page.locator("#alternatives-box").is_hidden()

    with page.expect_response(lambda r: "/api/caption" in r.url):
        page.click("#text-clear")  # back to the model's own caption
    page.wait_for_selector(f"#status:has-text('“{searched['caption']}”')")
    assert page.input_value("#text") == "" and page.locator(".word").count() == len(searched["tokens"])


def test_a_word_the_model_does_not_know_shows_the_servers_sentence(page):
    _caption(page)
    page.locator(".word").nth(1).hover()
    assert _overlay(page).max() > 0
    answer = _score(page, "a red zebra")
    assert answer.status == 422
    page.wait_for_selector("#status.error")
    assert page.locator("#status").inner_text() == answer.json()["error"]
    assert page.locator(".word").count() == 0 and _overlay(page).max() == 0  # nothing left of the last answer
