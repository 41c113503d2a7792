"""Shared test setup: every test starts from the same random state, and caches go to a temporary
folder, never to the user's ~/.cache/captioner. Under pytest-xdist (`make test` runs two workers,
one file per worker at a time) each worker gets its share of the CPU's threads, subprocesses too."""
import os
import random

import numpy as np
import pytest
import torch

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


# The demo first, then quick files: with two workers (`make test`) xdist hands each worker a first
# batch of files (about a quarter of them, split between the workers); the demo's worker runs the
# rest of its batch only after the demo, so that batch should be cheap while the other worker takes
# everything else.
FIRST = ("test_demo.py", "test_layers.py", "test_attention.py", "test_vocab.py", "test_loss.py", "test_decoder.py",
         "test_images.py", "test_sources.py", "test_order.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)
