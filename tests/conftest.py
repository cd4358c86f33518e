"""Tests run on CPU unless the caller chose a platform (JAX_PLATFORMS=cuda on a GPU machine)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the platform is chosen)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax default backend is %s)" % jax.default_backend())
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
