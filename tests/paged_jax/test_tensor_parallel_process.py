"""Runs tests/distributed in a process that simulates 8 devices (XLA_FLAGS must be set before
jax is imported, which this process did long ago)."""
import os
import subprocess
import sys
from pathlib import Path

from pallas_kernels import triton_call

ROOT = Path(__file__).resolve().parents[2]


def test_tensor_parallel_suite_in_its_own_process():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"  # the suite's, and 8
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/distributed"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    # nothing skips; on a jax without Pallas Triton, its one test there (the export of its kernels)
    summary = result.stdout.splitlines()[-1]
    assert ("skipped" not in summary) if triton_call.AVAILABLE else (" 1 skipped" in summary), result.stdout[-2000:]
