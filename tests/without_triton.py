"""A jax that has dropped Pallas Triton (deprecated since jax 0.11), simulated: `hide()` makes
importing `jax.experimental.pallas.triton` fail as it will once jax removes it. Call it before
anything imports the package; `PAGED_JAX_WITHOUT_TRITON=1 pytest` runs the whole suite that way
(tests marked `triton` skip)."""
import importlib.abc
import sys

ENV = "PAGED_JAX_WITHOUT_TRITON"
HIDDEN = ("jax.experimental.pallas.triton", "jax._src.pallas.triton")


class _Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/without_triton.py)",
                                      name=name)
        return None


def hide():
    loaded = [m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in HIDDEN)]
    if loaded:
        raise RuntimeError(f"hide() must run before these are imported: {loaded}")
    if not any(isinstance(f, _Hidden) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hidden())
