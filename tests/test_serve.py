"""The HTTP API in-process (FastAPI's test client): answers, every bad input, batching under load."""
import io
import json
import threading

import numpy as np
import PIL.Image
import pytest
from fastapi.testclient import TestClient

from captioner.cli import main
from captioner.decoding.captioner import Captioner
from captioner.errors import CaptionerError
from captioner.serve.app import Limits, create_app
from captioner.serve.batcher import Batcher, Options
from captioner.serve.page import examples_for


@pytest.fixture(scope="module")
def client(sharp_captioner):
    app = create_app(sharp_captioner, "sharp.pt", Limits(max_bytes=200_000, max_pixels=1_000_000), max_batch=8,
                     max_delay_ms=20, examples=examples_for("shapes"))
    with TestClient(app) as c:
        yield c


def _png(seed: int = 0, size=(96, 72), **save) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG", **save)
    return buffer.getvalue()


def _flat(size) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", size).save(buffer, "PNG")
    return buffer.getvalue()


def test_an_answer_is_the_caption_json_with_maps_that_sum_to_one(client, sharp_captioner):
    r = client.post("/api/caption?alternatives=2", files={"image": ("photo.png", _png(), "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    (expected,) = sharp_captioner.caption([PIL.Image.open(io.BytesIO(_png()))], alternatives=2)
    assert body["caption"] == expected.text and body["tokens"] == expected.tokens
    assert body["score"] == pytest.approx(expected.score)
    T, (rows, cols) = len(body["tokens"]), body["grid"]
    attention = np.asarray(body["attention"])
    assert attention.shape == (T, rows, cols) == (T, 4, 4)
    np.testing.assert_allclose(attention.sum(axis=(1, 2)), 1.0, atol=1e-5)
    assert body["cells"] == sharp_captioner.model.encoder.cells._asdict() and body["image_size"] == [96, 72]
    assert [f["peak"] for f in body["focus"]] == pytest.approx(attention.max(axis=(1, 2)).tolist())
    assert all(0.0 <= f["spread"] <= 1.0 for f in body["focus"])
    alternatives = body["alternatives"]
    assert len(alternatives) == 2 and [a["caption"] for a in alternatives] == [a.text for a in expected.alternatives]
    assert all(a["score"] <= body["score"] for a in alternatives)
    assert {"caption", "tokens", "score", "logprob", "finished"} <= set(alternatives[0])


def test_raw_bytes_and_decode_options(client):
    r = client.post("/api/caption?beam=1&max_length=3", content=_png(1), headers={"content-type": "image/png"})
    assert r.status_code == 200 and 1 <= len(r.json()["tokens"]) <= 3 and "alternatives" not in r.json()


def test_exif_rotated_photos_are_captioned_upright(client):
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # stored sideways: rotate 90 degrees to display
    r = client.post("/api/caption", content=_png(2, (96, 72), exif=exif))
    assert r.status_code == 200 and r.json()["image_size"] == [72, 96]


@pytest.mark.parametrize("query, message", [
    ("beam=0", "beam: Input should be greater than or equal to 1 (got '0')"),
    ("beam=many", "beam: Input should be a valid integer, unable to parse string as an integer (got 'many')"),
    ("max_length=500", "max_length: Input should be less than or equal to 50 (got '500')"),
    ("beam=2&alternatives=2", "alternatives: 2 needs a beam of at least 3 (beam is 2)"),
])
def test_bad_options_are_422_with_one_sentence(client, query, message):
    r = client.post(f"/api/caption?{query}", content=_png())
    assert r.status_code == 422 and r.json() == {"error": message}


@pytest.mark.parametrize("body, status, message", [
    (b"GIF89a but not really", 415, "upload: not an image (format not recognised)"),
    (b"", 415, "upload: empty upload"),
    (b"%PDF-1.4 a document", 415, "upload: not an image"),
    (_png()[:300], 422, "upload: truncated or corrupt image"),
    (_flat((1200, 1000)), 413, "upload: 1200x1000 pixels is more than the 1,000,000 allowed"),  # a bomb: 4 kB
])
def test_bad_images_get_the_right_status(client, body, status, message):
    r = client.post("/api/caption", content=body, headers={"content-type": "application/octet-stream"})
    assert r.status_code == status and r.json()["error"].startswith(message), r.text


def test_too_many_bytes_is_413_before_the_body_is_read(client):
    big = b"\x89PNG" + bytes(300_000)
    r = client.post("/api/caption", content=big)
    assert r.status_code == 413 and "larger than the 0.191 MB allowed" in r.json()["error"]
    chunked = client.post("/api/caption", content=iter([big[:150_000], big[150_000:]]))  # no Content-Length
    assert chunked.status_code == 413
    form = client.post("/api/caption", files={"image": ("big.png", big, "image/png")})
    assert form.status_code == 413


def test_a_form_without_an_image_field_is_422(client):
    r = client.post("/api/caption", files={"photo": ("a.png", _png(), "image/png")})
    assert r.status_code == 422 and r.json() == {"error": "multipart body without an 'image' field (fields: photo)"}


TEXT = "a red circle above a blue square"


def test_text_answers_where_the_model_looks_for_the_given_words(client, sharp_captioner):
    (expected,) = sharp_captioner.caption([PIL.Image.open(io.BytesIO(_png(4)))], text=TEXT)
    query = client.post("/api/caption", params={"text": TEXT}, content=_png(4))
    form = client.post("/api/caption", files={"image": ("p.png", _png(4), "image/png")}, data={"text": TEXT})
    for r in (query, form):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == TEXT.split() and body["caption"] == TEXT and "alternatives" not in body
        assert body["word_logprobs"] == pytest.approx(expected.word_logprobs)
        assert all(p < 0 for p in body["word_logprobs"]) and body["logprob"] < sum(body["word_logprobs"])  # + <end>
        attention = np.asarray(body["attention"])
        np.testing.assert_allclose(attention, expected.attention, atol=1e-6)
        np.testing.assert_allclose(attention.sum(axis=(1, 2)), 1.0, atol=1e-5)
        assert len(body["focus"]) == len(body["tokens"])
    searched = client.post("/api/caption", params={"text": "  "}, content=_png(4)).json()  # blank: the search
    assert "word_logprobs" not in searched and searched["caption"] == sharp_captioner.caption(
        [PIL.Image.open(io.BytesIO(_png(4)))])[0].text


def test_words_the_model_does_not_know_are_422_with_the_captioners_sentence(client, sharp_captioner, caplog):
    with pytest.raises(CaptionerError) as known:
        sharp_captioner.caption([PIL.Image.new("RGB", (8, 8))], text="a red zebra")
    r = client.post("/api/caption", params={"text": "a red zebra"}, content=_png())
    assert r.status_code == 422 and r.json() == {"error": str(known.value)} and "zebra" in r.json()["error"]
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]  # the client's mistake: no traceback
    form = client.post("/api/visualize", files={"image": ("p.png", _png(), "image/png")}, data={"text": "a zebra"})
    assert form.status_code == 422 and "zebra" in form.json()["error"]


@pytest.mark.parametrize("query, form, message", [
    ({"text": TEXT, "alternatives": "2"}, None, "alternatives: a caption given as text has none (nothing is searched)"),
    ({"alternatives": "2"}, TEXT, "alternatives: a caption given as text has none (nothing is searched)"),
    ({"text": TEXT}, TEXT, "text: given twice (as a query parameter and a form field)"),
    ({"text": "a " * 151}, None, "text: String should have at most 300 characters"),
    ({}, "a " * 151, "text: 302 characters, at most 300 allowed"),
])
def test_bad_text_requests_are_422(client, query, form, message):
    data = None if form is None else {"text": form}
    r = client.post("/api/caption", params=query, files={"image": ("p.png", _png(), "image/png")}, data=data)
    assert r.status_code == 422 and r.json()["error"].startswith(message), r.text


def test_visualize_draws_the_given_words(client):
    r = client.post("/api/visualize", params={"text": "a red circle"}, content=_png())
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"


def test_health_model_page_and_docs(client):
    assert client.get("/api/health").json()["status"] == "ok"
    model = client.get("/api/model").json()
    assert model["grid"] == [4, 4] and model["vocabulary"] == 20 and model["decode"]["beam_size"] == 3
    assert model["limits"]["max_bytes"] == 200_000 and "two-shapes.png" in model["examples"]
    page = client.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert client.get("/static/examples/two-shapes.png").headers["content-type"] == "image/png"
    assert client.get("/static/../app.py").status_code == 404
    assert "/api/caption" in client.get("/openapi.json").json()["paths"]


def test_visualize_draws_the_png(client):
    r = client.post("/api/visualize", files={"image": ("photo.png", _png(), "image/png")})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert PIL.Image.open(io.BytesIO(r.content)).size[0] > 300


def test_concurrent_requests_are_all_answered_correctly_and_batched(sharp_checkpoint_file, sharp_captioner):
    app = create_app(sharp_captioner, "sharp.pt", max_batch=8, max_delay_ms=50)
    images = [_png(seed) for seed in range(24)]
    expected = [c.text for c in sharp_captioner.caption([PIL.Image.open(io.BytesIO(b)) for b in images])]
    answers: dict[int, str] = {}
    with TestClient(app) as client:
        def ask(i: int) -> None:
            r = client.post("/api/caption", content=images[i])
            answers[i] = r.json()["caption"] if r.status_code == 200 else f"HTTP {r.status_code}"

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(images))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = client.get("/api/health").json()
    assert [answers[i] for i in range(len(images))] == expected
    assert stats["images"] == 24 and stats["batches"] < 24 and 1 < stats["largest"] <= 8


def test_the_batcher_groups_by_options_and_keeps_order(sharp_captioner):
    images = [PIL.Image.open(io.BytesIO(_png(seed))) for seed in range(6)]
    with Batcher(sharp_captioner, max_batch=6, max_delay_ms=100) as batcher:
        futures = [batcher.submit(im, Options(beam_size=1 + i % 2, max_length=6)) for i, im in enumerate(images)]
        got = [f.result(timeout=30).text for f in futures]
    assert batcher.stats.batches == 2 and batcher.stats.images == 6
    for i, im in enumerate(images):
        assert got[i] == sharp_captioner.caption([im], beam_size=1 + i % 2, max_length=6)[0].text
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(images[0], Options(1, 6))
    with Batcher(sharp_captioner, max_batch=6, max_delay_ms=100) as batcher:  # two texts and a search: three groups
        texts = ["a red circle", None, "there is a purple square"]
        futures = [batcher.submit(im, Options(3, 6, text=texts[i % 3])) for i, im in enumerate(images)]
        got = [f.result(timeout=30) for f in futures]
    assert batcher.stats.batches == 3
    for i, caption in enumerate(got):
        if texts[i % 3]:
            assert caption.tokens == texts[i % 3].split() and len(caption.word_logprobs) == len(caption.tokens)
        else:
            assert caption.word_logprobs is None
            assert caption.text == sharp_captioner.caption([images[i]], max_length=6)[0].text


def test_a_busy_port_is_one_line_before_the_model_loads(sharp_checkpoint_file, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--checkpoint", str(sharp_checkpoint_file), "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"captioner: error: 127.0.0.1:{port}: cannot listen there")
    assert "\n" not in err


def test_caption_json_matches_the_cli(sharp_checkpoint_file, tmp_path, capsys, client):
    path = tmp_path / "photo.png"
    path.write_bytes(_png(3))
    assert main(["caption", str(path), "--checkpoint", str(sharp_checkpoint_file), "--json", "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = client.post("/api/caption", content=_png(3)).json()
    for key in ("caption", "tokens", "score", "logprob", "finished", "attention", "cells"):
        assert api[key] == cli[key], key


def test_a_large_jpeg_reaches_the_model_as_the_cli_reads_it(client, sharp_checkpoint_file, tmp_path, monkeypatch, capsys):
    """`caption FILE` decodes a large JPEG at a reduced scale (draft mode); `visualize FILE` and an
    upload of the same file must give the model those same pixels, so all three write one caption."""
    photo = tmp_path / "large.jpg"
    PIL.Image.fromarray(np.random.default_rng(3).integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(photo)
    seen: list[tuple[int, int]] = []
    preprocess = Captioner.preprocess
    monkeypatch.setattr(Captioner, "preprocess", lambda self, image: seen.append(image.size) or preprocess(self, image))
    assert main(["caption", str(photo), "--checkpoint", str(sharp_checkpoint_file), "--device", "cpu"]) == 0
    assert main(["visualize", str(photo), "--checkpoint", str(sharp_checkpoint_file), "--device", "cpu",
                 "-o", str(tmp_path / "v.png")]) == 0
    r = client.post("/api/caption", files={"image": ("large.jpg", photo.read_bytes(), "image/jpeg")})
    assert r.status_code == 200, r.text
    assert r.json()["image_size"] == [640, 480]  # the photo's own size, for placing the maps
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0][0] < 640  # one reduced decode, three times
    printed = [line.split("\t")[1] for line in capsys.readouterr().out.splitlines() if "\t" in line]
    assert printed == [r.json()["caption"]] * 2
