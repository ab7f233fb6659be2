import numpy as np
import pytest


@pytest.fixture(scope="session")
def assets():
    """The all-MiniLM-L6-v2 files, read once per session (skips if the package is missing)."""
    from apir.models.assets import ModelNotInstalled, load_assets

    try:
        return load_assets()
    except ModelNotInstalled as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def weights64(assets):
    """The weights as float64, for the numpy reference."""
    return {k: v.astype(np.float64) for k, v in assets.weights.items()}


@pytest.fixture(scope="session")
def minilm(assets):
    """The model on ggml's local CPU backend, uploaded once per session."""
    from apir.models.minilm import MiniLM

    with MiniLM(assets=assets) as model:
        yield model
