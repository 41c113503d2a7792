"""The app's frame, in-process and through uvicorn: the lifespan (the model and its batcher on
app.state), JSON errors for everything (404, 405, a failing model, a bug: 500), a client that goes
away mid-upload, the schema /docs shows, example images that suit the model, and settings that do not fit."""
import dataclasses
import io
import json
import socket
import urllib.request

import numpy as np
import PIL.Image
import pytest
from fastapi.testclient import TestClient

from captioner.cli import build_parser, main
from captioner.cli import serve as serve_cli
from captioner.config import DataConfig
from captioner.decoding.captioner import Captioner
from captioner.model.checkpoint import load_checkpoint, save_checkpoint
from captioner.serve.app import create_app
from captioner.serve.batcher import Batcher, Options
from captioner.serve.page import examples_for

from servers import Server


@pytest.fixture(scope="module")
def client(sharp_captioner):
    with TestClient(create_app(sharp_captioner, "sharp.pt")) as c:
        yield c


def _png(seed: int = 0, size=(96, 72)) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


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
def test_a_failure_is_a_json_500_and_the_server_goes_on(sharp_captioner, where, message):
    app = create_app(_FailingModel(sharp_captioner, where), "failing.pt")
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


def test_the_model_and_its_batcher_live_on_app_state_for_the_lifespan(sharp_captioner):
    app = create_app(sharp_captioner, "sharp.pt")
    outside = TestClient(app)  # no lifespan: nothing served yet
    assert outside.get("/api/health").json() == {"status": "starting"}
    assert outside.get("/api/model").status_code == 503
    with TestClient(app) as client:
        assert app.state.captioner is sharp_captioner and app.state.batcher.stats.images == 0
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
    fields = {"caption", "tokens", "attention", "cells", "focus", "alternatives", "word_logprobs"}
    assert fields <= set(result["properties"])
    assert {"caption", "tokens", "attention"} <= set(result["required"]) and "alternatives" not in result["required"]
    error = spec["paths"]["/api/caption"]["post"]["responses"]["415"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/Error"}
    parameters = spec["paths"]["/api/caption"]["post"]["parameters"]
    assert [p["name"] for p in parameters][:3] == ["beam", "max_length", "alternatives"]
    assert spec["paths"]["/api/model"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelInfo"}
    docs = client.get("/docs").text  # Swagger UI from files the package ships: it works offline
    assert "swagger-ui" in docs and "cdn." not in docs
    script = docs.split('src="')[1].split('"')[0]
    assert script.endswith("swagger-ui-bundle.js") and client.get(script).status_code == 200


def test_examples_suit_the_model(sharp_checkpoint_file, sharp_captioner, tmp_path):
    assert examples_for("shapes").keys() == {"one-shape.png", "side-by-side.png", "three-shapes.png", "two-shapes.png"}
    assert examples_for("/data/flickr8k") == {}  # a photo model is offered no drawn shapes
    (tmp_path / "dog.jpg").write_bytes(b"jpeg")
    (tmp_path / "notes.txt").write_text("not an image")
    assert examples_for("/data/flickr8k", tmp_path) == {"dog.jpg": tmp_path / "dog.jpg"}

    photo = tmp_path / "photo.pt"  # the sharp model, as if trained on photos
    ckpt = load_checkpoint(sharp_checkpoint_file)
    save_checkpoint(photo, dataclasses.replace(ckpt.config, data=DataConfig(path="/data/flickr8k")), ckpt.vocab,
                    ckpt.model_state)
    parser = build_parser()
    assert serve_cli._examples(parser.parse_args(["serve", "--checkpoint", str(sharp_checkpoint_file)])).keys() == \
        examples_for("shapes").keys()
    assert serve_cli._examples(parser.parse_args(["serve", "--checkpoint", str(photo)])) == {}
    assert serve_cli._examples(parser.parse_args(["serve", "--checkpoint", str(photo), "--examples", str(tmp_path)])) \
        == {"dog.jpg": tmp_path / "dog.jpg"}

    with TestClient(create_app(sharp_captioner, "photo.pt", examples=examples_for("/data/flickr8k", tmp_path))) as client:
        assert client.get("/api/model").json()["examples"] == ["dog.jpg"]
        assert client.get("/examples/dog.jpg").content == b"jpeg"
        for name in ("notes.txt", "two-shapes.png", "..%2Fnotes.txt"):  # only the files listed at start
            r = client.get(f"/examples/{name}")
            assert r.status_code == 404 and r.headers["content-type"] == "application/json", name


def test_a_client_that_goes_away_mid_upload_is_one_log_line(sharp_checkpoint_file):
    """Through uvicorn as a user runs it: a raw socket sends headers promising 100 kB, half of them, and
    closes; the server logs one line (no traceback) and goes on answering."""
    server = Server(sharp_checkpoint_file)
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


def test_examples_must_be_a_folder(sharp_checkpoint_file, tmp_path, capsys):
    code = main(["serve", "--checkpoint", str(sharp_checkpoint_file), "--examples", str(tmp_path / "none")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"captioner: error: --examples {tmp_path / 'none'}: not a folder"


@pytest.mark.parametrize("option, value, shown", [
    ("--max-mb", "nan", "nan is not allowed (must be (0, 1024])"),  # was a ValueError from int(nan)
    ("--max-mb", "inf", "inf is not allowed (must be (0, 1024])"),  # an OverflowError
    ("--max-delay-ms", "nan", "nan is not allowed (must be [0, 10000])"),  # the model thread spun, never answering
    ("--max-delay-ms", "inf", "inf is not allowed (must be [0, 10000])"),  # the model thread died
    ("--max-delay-ms", "1e300", "1e+300 is not allowed (must be [0, 10000])"),  # past the longest wait a queue has
    ("--examples", "", "empty path (an unset shell variable?)"),  # was the current folder
])
def test_serving_settings_that_do_not_fit_are_one_line_before_any_work(option, value, shown, monkeypatch, capsys):
    def load_captioner(*args, **kwargs):
        raise AssertionError("the model loaded: the bad value was not refused first")

    monkeypatch.setattr(serve_cli, "load_captioner", load_captioner)
    code = main(["serve", "--port", "0", option, value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"captioner: error: {option}: {shown}"


@pytest.mark.parametrize("delay", [float("nan"), float("inf")])
def test_the_batcher_refuses_a_wait_that_never_ends(sharp_captioner, delay):
    with pytest.raises(ValueError, match="max_delay_ms"):
        Batcher(sharp_captioner, max_delay_ms=delay)
