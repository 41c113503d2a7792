"""Shared test setup: every test starts from the same random state."""
import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
