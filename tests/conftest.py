"""Shared test setup: every test starts from the same random state, and caches go to a temporary
folder, never to the user's ~/.cache/captioner."""
import random

import numpy as np
import pytest
import torch


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("captioner-cache")


@pytest.fixture(autouse=True)
def seed_and_cache(monkeypatch, session_cache) -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    monkeypatch.setenv("CAPTIONER_CACHE", str(session_cache))
