"""jax's persistent compilation cache in a user cache directory, so that a second start of a script
loads the programs the first compiled instead of compiling them again (XLA's compile is most of a
small model's start-up time)."""
from __future__ import annotations

import os
from pathlib import Path

import jax


def default_cache_dir(kind: str = "jax") -> Path:
    """Where paged-jax keeps `kind`: "jax" (compiled programs) in $PAGED_JAX_CACHE_DIR, anything else
    (e.g. "models", scripts/fetch_model.py's) in $PAGED_JAX_CACHE_DIR/<kind>; without that variable
    $XDG_CACHE_HOME/paged-jax/<kind>, else ~/.cache/paged-jax/<kind> (the XDG base-directory default)."""
    if os.environ.get("PAGED_JAX_CACHE_DIR"):
        root = Path(os.environ["PAGED_JAX_CACHE_DIR"]).expanduser()
        return root if kind == "jax" else root / kind
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "paged-jax" / kind


def enable(cache_dir=None) -> Path:
    """Cache every compiled program under `cache_dir` (default: `default_cache_dir()`) -> the directory.

    Call it before the first compilation: jax opens the cache once, at the first compile that finds
    a directory set. jax's defaults skip programs that compile in under a second, which on a CPU is
    nearly all of ours (each one's second is small, their sum is not), so both thresholds are off."""
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size floor, none set later
    return path
