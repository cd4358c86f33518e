#!/usr/bin/env bash
# Install what the tests need and run them on both jax lines: the README's test command, and what
# CI runs. Exits non-zero if either line fails (both always run).
#  1. This machine's Python 3.11, whose newest jax is 0.10. torch==2.13.0 first: on these machines
#     it is a CPU build from local disk, while an unpinned torch (pulled in by the parity extra)
#     would download a multi-GB CUDA build.
#  2. A Python 3.13 venv (.venv-jax-latest) with the newest jax and flax from PyPI, what a new user
#     installs today; no torch there (that CUDA download), so the parity tests skip on this line.
#     The gpu-compile extra pins jax's CUDA plugin to the jax it installs, so pip settles on the
#     newest jax whose plugin is released: 0.12.0.1 while jax 0.12.1 has none (the line prints it).
# Both lines compile the kernels to cubins (tests/pallas_kernels/test_cubin.py); the IR is the
# same, so the second line reads the first one's stats (pallas_kernels/cubin.py: CACHE_DIR).
# Line 2 also installs the gpu-compile extra: XLA's GPU compiler, which compiles the engine's whole
# programs for an H100, H200 and A100 without one (tests/paged_jax/test_compile_for_gpu.py).
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
[ -x .venv-jax-latest/bin/python ] || "$latest" -m venv .venv-jax-latest
venv=.venv-jax-latest/bin/python
$venv -m pip install -q --upgrade pip
$venv -m pip install -q --upgrade jax flax
$venv -m pip install -q -e ".[test,gpu-compile]"
echo "== jax line 2: $($venv --version), jax $($venv -c 'import jax; print(jax.__version__)')"
$venv -m pytest -q "${workers[@]}" "$@" || status=$?
exit $status
