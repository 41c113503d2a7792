"""Shared test setup: every test starts from the same random state, and caches go to a temporary
folder, never to the user's ~/.cache/captioner. Under pytest-xdist (`make test` runs two workers)
each worker gets its share of the CPU's threads, subprocesses too."""
import os
import random

import numpy as np
import pytest
import torch

from captioner.decoding.captioner import Captioner

from exports import DECODERS, exported_once
from servers import sharp_checkpoint

if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = _threads
    torch.set_num_threads(int(_threads))


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("captioner-cache")


@pytest.fixture(autouse=True)
def seed_and_cache(monkeypatch, session_cache) -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    monkeypatch.setenv("CAPTIONER_CACHE", str(session_cache))


@pytest.fixture
def single_process(monkeypatch):
    """Training outside torchrun (no RANK, WORLD_SIZE, LOCAL_RANK) on one CPU thread: the machine is
    shared, and tiny ops do not need more."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sharp_checkpoint_file(tmp_path_factory):
    """The server tests' tiny checkpoint with sharp attention (tests/servers.py), one per module."""
    return sharp_checkpoint(tmp_path_factory.mktemp("serve") / "sharp.pt")


@pytest.fixture(scope="module")
def sharp_captioner(sharp_checkpoint_file) -> Captioner:
    return Captioner.from_checkpoint(sharp_checkpoint_file, device="cpu")


@pytest.fixture(params=list(DECODERS))
def each_exported(request, tmp_path_factory):
    """(checkpoint, export report) of each decoder layout and a two-scale encoder grid, each exported once."""
    return exported_once(tmp_path_factory, request.param)


@pytest.fixture
def exported(tmp_path_factory):
    """(checkpoint, export report) of the demo's decoder layout, exported once."""
    return exported_once(tmp_path_factory, "after-none")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The demo first: it is the longest test by far, and with two workers (`make test`, xdist's
    worksteal: each worker starts on its half of the list and takes work from the other when idle)
    the other worker then runs the rest of the suite beside it."""
    items.sort(key=lambda item: "test_demo.py" not in item.nodeid)
