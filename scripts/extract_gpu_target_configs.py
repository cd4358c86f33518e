"""Regenerate pallas_kernels/gpu_target_configs/*.txtpb: the GpuTargetConfigProto texts XLA embeds in
the installed jax-cuda12-pjrt plugin (xla_cuda_plugin.so), one per GPU we compile for.

    python scripts/extract_gpu_target_configs.py [--plugin PATH/xla_cuda_plugin.so]

Each text starts with XLA's "# proto-message" header and ends with its device_description_str line;
the file gets a provenance header (plugin version, sha256 of the library) in front of it."""
import argparse
import glob
import hashlib
import importlib.metadata
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pallas_kernels.gpu_target import CONFIG_DIR, DEVICE_NAMES  # noqa: E402

HEADER = b"# proto-message: stream_executor.GpuTargetConfigProto"


def default_plugin():
    import jax_plugins.xla_cuda12 as plugin
    found = glob.glob(os.path.join(os.path.dirname(plugin.__file__), "xla_cuda_plugin.so"))
    if not found:
        raise SystemExit("xla_cuda_plugin.so not found: pip install -e '.[gpu-compile]'")
    return found[0]


def read_config(library, device_name):
    """-> the text for `device_name` out of the library's bytes: from the last header before its
    device_description_str line to the end of that line."""
    marker = f'device_description_str: "{device_name}"\n'.encode()
    end = library.find(marker)
    if end < 0:
        raise ValueError(f"no target config for {device_name!r} in the plugin")
    start = library.rfind(HEADER, 0, end)
    return library[start:end + len(marker)].decode()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugin", default=None, help="path of xla_cuda_plugin.so")
    args = parser.parse_args()
    path = args.plugin or default_plugin()
    library = open(path, "rb").read()
    digest = hashlib.sha256(library).hexdigest()
    version = importlib.metadata.version("jax-cuda12-pjrt")
    os.makedirs(CONFIG_DIR, exist_ok=True)
    for gpu, device_name in DEVICE_NAMES.items():
        provenance = (f"# Read by scripts/extract_gpu_target_configs.py out of xla_cuda_plugin.so\n"
                      f"# (jax-cuda12-pjrt {version}, sha256 {digest[:16]}...); XLA's own text for\n"
                      f"# {device_name}, unchanged below.\n")
        with open(os.path.join(CONFIG_DIR, gpu + ".txtpb"), "w") as f:
            f.write(provenance + read_config(library, device_name))
        print(f"{gpu}: {device_name}")


if __name__ == "__main__":
    main()
