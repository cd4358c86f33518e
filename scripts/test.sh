#!/usr/bin/env bash
# Install what the tests need and run them on both jax lines: the README's test command, and what
# CI runs. Exits non-zero if any run fails (all always run).
#  1. This machine's Python 3.11, whose newest jax is 0.10. torch==2.13.0 first: on these machines
#     it is a CPU build from local disk, while an unpinned torch (pulled in by the parity extra)
#     would download a multi-GB CUDA build.
#  2. A Python 3.13 venv (.venv-jax-latest) with the newest jax and flax from PyPI, what a new user
#     installs today; no torch there (that CUDA download), so the parity tests skip on this line.
#  2g. The tests that compile for GPUs without one (GPU_COMPILE_TESTS: XLA's GPU compiler compiles
#     the engine's whole programs and the Mosaic GPU kernels for an H100, H200 and A100) in a second
#     Python 3.13 venv (.venv-jax-gpu-compile) with the gpu-compile extra. That extra pins jax's
#     CUDA plugin to the jax it installs, so pip settles there on the newest jax whose plugin is
#     released (0.12.0.1 while jax 0.12.1 has none); line 2 keeps the newest jax itself.
# Both lines compile the kernels to cubins (tests/pallas_kernels/test_cubin.py); the IR is the
# same, so the second line reads the first one's stats (pallas_kernels/cubin.py: CACHE_DIR).
# The suite runs on PYTEST_WORKERS pytest-xdist workers (2: the CI machine's cores), a test file on
# one worker (--dist loadfile), so a module's fixtures (servers, engines) are built once.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0

echo "== jax line 1: $(python3 --version), newest jax for it"
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test,parity]"
workers=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
python3 -m pytest -q "${workers[@]}" "$@" || status=$?

latest="${PYTHON_LATEST:-$(pyenv root 2>/dev/null || echo /nonexistent)/versions/3.13.0/bin/python3.13}"
if [ ! -x "$latest" ]; then
    echo "no Python 3.13 at $latest: set PYTHON_LATEST to a Python >= 3.12" >&2
    exit 1
fi
venv() {  # venv DIR EXTRAS: a Python 3.13 venv with the newest jax and flax pip can settle on
    [ -x "$1/bin/python" ] || "$latest" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
    "$1/bin/python" -m pip install -q --upgrade jax flax
    "$1/bin/python" -m pip install -q -e ".[$2]"
}
version() { "$1/bin/python" -c 'import jax; print("jax", jax.__version__)'; }

venv .venv-jax-latest test
echo "== jax line 2: $(.venv-jax-latest/bin/python --version), $(version .venv-jax-latest)"
.venv-jax-latest/bin/python -m pytest -q "${workers[@]}" "$@" || status=$?

GPU_COMPILE_TESTS=(tests/paged_jax/test_compile_for_gpu.py tests/pallas_kernels/test_gpu_target.py
                   tests/pallas_kernels/test_mosaic_compile.py)
venv .venv-jax-gpu-compile test,gpu-compile
echo "== jax line 2g, the GPU compiles: $(version .venv-jax-gpu-compile), $(.venv-jax-gpu-compile/bin/python -c \
    'import importlib.metadata as m; print("jax-cuda12-pjrt", m.version("jax-cuda12-pjrt"))')"
.venv-jax-gpu-compile/bin/python -m pytest -q "${workers[@]}" "$@" "${GPU_COMPILE_TESTS[@]}" || status=$?
exit $status
