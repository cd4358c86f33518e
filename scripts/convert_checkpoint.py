"""Convert a Hugging Face safetensors checkpoint to an Orbax one, once, so later starts restore directly.

    python scripts/convert_checkpoint.py HF_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR gets config.json, the tokenizer files and the parameters (state/); `models.load_model(OUT_DIR)`
and `LLM(OUT_DIR)` read it."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from models.checkpoint import load_hf, save_orbax  # noqa: E402
from models.llama import SUPPORTED_DTYPES  # noqa: E402


def directory_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def convert(hf_dir, out_dir, *, dtype=None) -> dict:
    """HF_DIR -> OUT_DIR; returns the numbers main() prints (seconds, bytes, parameters, dtype)."""
    start = time.perf_counter()
    model = load_hf(hf_dir, dtype=dtype)
    loaded = time.perf_counter()
    save_orbax(model, out_dir, source_dir=hf_dir)
    done = time.perf_counter()
    params = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))))
    return dict(load_s=loaded - start, save_s=done - loaded, bytes=directory_bytes(out_dir),
                params=params, dtype=model.config.dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", help="Hugging Face directory: config.json + *.safetensors")
    parser.add_argument("out_dir", help="Orbax output directory (its state/ is overwritten)")
    parser.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=None,
                        help="parameter dtype (default: the checkpoint's; float16 becomes bfloat16)")
    args = parser.parse_args(argv)
    stats = convert(args.hf_dir, args.out_dir, dtype=args.dtype)
    print(f"converted {args.hf_dir} -> {args.out_dir}: {stats['params'] / 1e6:.1f}M params "
          f"({stats['dtype']}), {stats['bytes'] / 2**20:.1f} MiB on disk; "
          f"load {stats['load_s']:.2f} s, save {stats['save_s']:.2f} s")
    return stats


if __name__ == "__main__":
    main()
