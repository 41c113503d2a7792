"""The package as users install it: a wheel (not the editable checkout) runs `captioner demo`, carries every
shipped config, and captions with a bundled model without torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bundle_a_model(package: Path) -> None:
    """A tiny export as the package's bundled model (captioner/models/flickr8k), when the onnx extra is
    installed to make one."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return
    from captioner.deploy.export import export_onnx
    from exports import tiny_checkpoint

    folder = package / "models" / "flickr8k"
    shutil.rmtree(folder, ignore_errors=True)  # the real one, if this checkout holds it: the tiny one is enough
    export_onnx(tiny_checkpoint(package.parent / "tiny.pt"), folder)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built into a wheel and installed (without dependencies: they are this venv's)
    into a folder of its own; with a tiny model bundled when the onnx extra is installed."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "captioner", source / "captioner", ignore=shutil.ignore_patterns("__pycache__"))
    _bundle_a_model(source / "captioner")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "wheels"), str(source)],
                   check=True, capture_output=True)
    (wheel,) = (tmp / "wheels").glob("captioner-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
                   check=True, capture_output=True)
    return tmp / "site"


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(args, env=env, cwd=site.parent, capture_output=True, text=True, timeout=120)


def test_the_installed_package_is_the_one_that_runs(installed):
    out = _run(installed, sys.executable, "-c", "import captioner; print(captioner.__file__)")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(installed)


def test_captioner_demo_runs_from_the_wheel(installed):
    out = _run(installed, str(installed / "bin" / "captioner"), "demo", "--help")
    assert out.returncode == 0, out.stderr
    assert "shapes" in out.stdout and "--out" in out.stdout


def test_every_shipped_config_loads_from_the_wheel(installed):
    code = ("from captioner.config import CONFIG_DIR, load_config, shipped_configs\n"
            "names = shipped_configs()\n"
            "configs = [load_config(n, ['train.init=ce.pt']) for n in names]\n"
            "print(CONFIG_DIR, *names, configs[names.index('shapes')].model.decoder.attend)")
    out = _run(installed, sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    folder, *names, attend = out.stdout.split()
    assert Path(folder).is_relative_to(installed)
    assert names == ["coco", "flickr8k", "flickr8k-800", "flickr8k-800-scst", "flickr8k-scst", "shapes"]
    assert attend == "after"


def test_the_page_ships_in_the_wheel(installed):
    code = ("from fastapi.testclient import TestClient\n"
            "from captioner.serve.page import STATIC\n"
            "print(STATIC, *sorted(p.relative_to(STATIC).as_posix() for p in STATIC.rglob('*') if p.is_file()))")
    out = _run(installed, sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    folder, *files = out.stdout.split()
    assert Path(folder).is_relative_to(installed)
    assert {"index.html", "app.js", "style.css", "examples/two-shapes.png"} <= set(files)


def test_the_bundled_model_ships_in_the_wheel_and_captions_without_torch(installed, tmp_path):
    bundled = installed / "captioner" / "models" / "flickr8k"
    if not bundled.is_dir():
        pytest.skip("the onnx extra is not installed: no model to bundle")
    assert {p.name for p in bundled.iterdir()} >= {"manifest.json", "encoder.onnx", "memory.onnx", "step.onnx"}
    import PIL.Image

    photo = tmp_path / "photo.png"
    PIL.Image.new("RGB", (80, 60), (200, 30, 30)).save(photo)
    code = ("import sys\n"
            "from captioner.cli import main\n"
            "code = main(['caption', sys.argv[1], '--json'])\n"
            "print(sorted(m for m in ('torch', 'torchvision', 'timm') if m in sys.modules), file=sys.stderr)\n"
            "sys.exit(code)")
    out = _run(installed, sys.executable, "-c", code, str(photo))
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]"
    row = json.loads(out.stdout)
    assert row["path"] == str(photo) and row["tokens"] and len(row["attention"]) == len(row["tokens"])
