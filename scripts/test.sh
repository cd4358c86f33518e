#!/usr/bin/env bash
# Install what the tests need and run them: the README's test command, and what CI runs.
# torch==2.13.0 first: on these machines it is a CPU build from local disk, while an unpinned
# torch (pulled in by the parity extra) would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test,parity]"
python3 -m pytest -q "$@"
