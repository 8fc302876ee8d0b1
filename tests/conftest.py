import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("functrain", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=os.environ.get("CI") == "true")
settings.load_profile("functrain")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
