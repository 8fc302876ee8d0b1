"""The model matrix under inductor: every family of tests/models/tiny_models.py compiled with code generation.

tests/models/test_model_matrix.py checks every family through functrain's capture with ``aot_eager`` and GPT-2, T5
and Whisper with inductor; this file compiles the others with inductor too (tens of seconds of CPU each, cold).
It runs where ``FUNCTRAIN_MODEL_MATRIX=inductor`` is set: CI's second half (.ci/run, the newest torch), so that the
suite's first half stays in its time budget; ``FUNCTRAIN_MODEL_MATRIX=inductor pytest tests/models`` runs it here.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

from tiny_models import MODELS  # noqa: E402
from test_model_matrix import INDUCTOR, check_compiles_whole  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("FUNCTRAIN_MODEL_MATRIX") != "inductor",
                                reason="the inductor model matrix runs in CI's second half "
                                       "(FUNCTRAIN_MODEL_MATRIX=inductor)")


@pytest.mark.parametrize("name", sorted(set(MODELS) - set(INDUCTOR)))
def test_the_model_compiles_whole_with_inductor(name):
    check_compiles_whole(name, None)
