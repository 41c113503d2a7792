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
from captioner.serve.app import Limits, create_app
from captioner.serve.batcher import Batcher, Options
from captioner.serve.page import examples_for

from servers import Server, sharp_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return sharp_checkpoint(tmp_path_factory.mktemp("serve") / "sharp.pt")


@pytest.fixture(scope="module")
def captioner(checkpoint):
    return Captioner.from_checkpoint(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def client(captioner):
    app = create_app(captioner, "sharp.pt", Limits(max_bytes=200_000, max_pixels=1_000_000), max_batch=8,
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


def test_an_answer_is_the_caption_json_with_maps_that_sum_to_one(client, captioner):
    r = client.post("/api/caption?alternatives=2", files={"image": ("photo.png", _png(), "image/png")})
    assert r.status_code == 200, r.text
    body = r.json()
    (expected,) = captioner.caption([PIL.Image.open(io.BytesIO(_png()))], alternatives=2)
    assert body["caption"] == expected.text and body["tokens"] == expected.tokens
    assert body["score"] == pytest.approx(expected.score)
    T, (rows, cols) = len(body["tokens"]), body["grid"]
    attention = np.asarray(body["attention"])
    assert attention.shape == (T, rows, cols) == (T, 4, 4)
    np.testing.assert_allclose(attention.sum(axis=(1, 2)), 1.0, atol=1e-5)
    assert body["cells"] == captioner.model.encoder.cells._asdict() and body["image_size"] == [96, 72]
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


def test_concurrent_requests_are_all_answered_correctly_and_batched(checkpoint, captioner):
    app = create_app(captioner, "sharp.pt", max_batch=8, max_delay_ms=50)
    images = [_png(seed) for seed in range(24)]
    expected = [c.text for c in captioner.caption([PIL.Image.open(io.BytesIO(b)) for b in images])]
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


def test_the_batcher_groups_by_options_and_keeps_order(captioner):
    images = [PIL.Image.open(io.BytesIO(_png(seed))) for seed in range(6)]
    with Batcher(captioner, max_batch=6, max_delay_ms=100) as batcher:
        futures = [batcher.submit(im, Options(beam_size=1 + i % 2, max_length=6)) for i, im in enumerate(images)]
        got = [f.result(timeout=30).text for f in futures]
    assert batcher.stats.batches == 2 and batcher.stats.images == 6
    for i, im in enumerate(images):
        assert got[i] == captioner.caption([im], beam_size=1 + i % 2, max_length=6)[0].text
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(images[0], Options(1, 6))


def test_a_busy_port_is_one_line_before_the_model_loads(checkpoint, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--checkpoint", str(checkpoint), "--port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"captioner: error: 127.0.0.1:{port}: cannot listen there")
    assert "\n" not in err


def test_caption_json_matches_the_cli(checkpoint, tmp_path, capsys, client):
    path = tmp_path / "photo.png"
    path.write_bytes(_png(3))
    assert main(["caption", str(path), "--checkpoint", str(checkpoint), "--json", "--device", "cpu"]) == 0
    cli = json.loads(capsys.readouterr().out)
    api = client.post("/api/caption", content=_png(3)).json()
    for key in ("caption", "tokens", "score", "logprob", "finished", "attention", "cells"):
        assert api[key] == cli[key], key


class _FailingModel(Captioner):
    """A model that fails on the model thread (`caption_pixels`) or on the request thread (`preprocess`)."""

    def __init__(self, captioner: Captioner, where: str) -> None:
        super().__init__(captioner.model, captioner.vocab, captioner.decode, "cpu")
        self.where = where

    def caption_pixels(self, *args, **kwargs):
        if self.where == "model":
            raise RuntimeError("CUDA out of memory")
        return super().caption_pixels(*args, **kwargs)

    def preprocess(self, image):
        if self.where == "request":
            raise RuntimeError("a bug in the preprocessing")
        return super().preprocess(image)


@pytest.mark.parametrize("where, message", [
    ("model", "the model failed on this image (RuntimeError)"),
    ("request", "the server failed on this request (RuntimeError); its log has the details"),
])
def test_a_failure_is_a_json_500_and_the_server_goes_on(captioner, where, message):
    app = create_app(_FailingModel(captioner, where), "failing.pt")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/api/caption", content=_png())
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json() == {"error": message}
        assert client.get("/api/health").json()["status"] == "ok"
        assert client.post("/api/caption?beam=0", content=_png()).status_code == 422


def test_unknown_paths_and_methods_are_json_too(client):
    assert client.get("/api/nothing").json() == {"error": "Not Found"}
    r = client.get("/api/caption")
    assert r.status_code == 405 and r.json() == {"error": "Method Not Allowed"}


def test_the_model_and_its_batcher_live_on_app_state_for_the_lifespan(captioner):
    app = create_app(captioner, "sharp.pt")
    outside = TestClient(app)  # no lifespan: nothing served yet
    assert outside.get("/api/health").json() == {"status": "starting"}
    assert outside.get("/api/model").status_code == 503
    with TestClient(app) as client:
        assert app.state.captioner is captioner and app.state.batcher.stats.images == 0
        assert client.post("/api/caption", content=_png()).status_code == 200
        batcher = app.state.batcher
    assert app.state.batcher is None and app.state.captioner is None
    with pytest.raises(RuntimeError, match="closed"):  # the model thread stopped with the app
        batcher.submit(PIL.Image.new("RGB", (8, 8)), Options(1, 4))


def test_the_docs_show_the_caption_schema(client):
    spec = client.get("/openapi.json").json()
    ok = spec["paths"]["/api/caption"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/CaptionResult"}
    result = spec["components"]["schemas"]["CaptionResult"]
    assert {"caption", "tokens", "attention", "cells", "focus", "alternatives", "word_logprobs"} <= set(result["properties"])
    assert {"caption", "tokens", "attention"} <= set(result["required"]) and "alternatives" not in result["required"]
    error = spec["paths"]["/api/caption"]["post"]["responses"]["415"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/Error"}
    parameters = spec["paths"]["/api/caption"]["post"]["parameters"]
    assert [p["name"] for p in parameters][:3] == ["beam", "max_length", "alternatives"]
    assert spec["paths"]["/api/model"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelInfo"}
    assert "swagger-ui" in client.get("/docs").text


def test_examples_suit_the_model(captioner, tmp_path):
    assert examples_for("shapes").keys() == {"one-shape.png", "side-by-side.png", "three-shapes.png", "two-shapes.png"}
    assert examples_for("/data/flickr8k") == {}  # a photo model is offered no drawn shapes
    (tmp_path / "dog.jpg").write_bytes(b"jpeg")
    (tmp_path / "notes.txt").write_text("not an image")
    assert examples_for("/data/flickr8k", tmp_path) == {"dog.jpg": tmp_path / "dog.jpg"}

    with TestClient(create_app(captioner, "photo.pt", examples=examples_for("/data/flickr8k", tmp_path))) as client:
        assert client.get("/api/model").json()["examples"] == ["dog.jpg"]
        assert client.get("/examples/dog.jpg").content == b"jpeg"
        for name in ("notes.txt", "two-shapes.png", "..%2Fnotes.txt"):  # only the files listed at start
            r = client.get(f"/examples/{name}")
            assert r.status_code == 404 and r.headers["content-type"] == "application/json", name


def test_a_client_that_goes_away_mid_upload_is_one_log_line(checkpoint):
    """Through uvicorn as a user runs it: a raw socket sends headers promising 100 kB, half of them, and
    closes; the server logs one line (no traceback) and goes on answering."""
    import socket
    import urllib.request

    server = Server(checkpoint)
    try:
        host, port = server.url.split("//")[1].rstrip("/").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /api/caption HTTP/1.1\r\nHost: test\r\nContent-Type: image/png\r\n"
                         b"Content-Length: 100000\r\n\r\n" + _png()[:50_000])
        with urllib.request.urlopen(urllib.request.Request(f"{server.url}api/caption", data=_png(),
                                                           method="POST")) as answer:
            assert answer.status == 200 and json.load(answer)["tokens"]
    finally:
        assert server.stop() == 0
    log = server.process.stdout.read().splitlines()
    assert log[-1] == "stopped"
    assert len(log) == 2 and "went away during its upload to /api/caption" in log[0], log
