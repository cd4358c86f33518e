"""What jax hands XLA for our GPU path, read on a machine without a GPU: a jitted function exported
for CUDA inside `targets.abstract_target`, and the Triton IR (ttir) of each of its pallas_calls.

The Triton module is read through jax's internal hook,
`jax._src.pallas.triton.pallas_call_registration.lowering.lower_jaxpr_to_triton_module` (the same
name on jax 0.10 and 0.12). If jax moves it, `triton_kernels` raises naming what moved: it never
returns fewer kernels than the export holds."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re

import jax

from pallas_kernels import targets

TRITON = "__gpu$xla.gpu.triton"  # the custom call every Triton pallas_call lowers to
HOOK_MODULE = "jax._src.pallas.triton.pallas_call_registration"
HOOK = "lower_jaxpr_to_triton_module"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str  # the pallas_call's name=
    ttir: str  # the Triton module jax lowered, as MLIR text
    compute_capability: int | None  # the arch jax lowered for (None: no arch-specific lowering)
    num_warps: int
    num_stages: int


def export(fn, *args, target, donate=()):
    """-> the StableHLO text of `fn` jitted and exported for CUDA as built for GPU `target`."""
    with targets.abstract_target(target):
        exported = jax.export.export(
            jax.jit(fn, donate_argnums=donate), platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exported.mlir_module()


def triton_calls(module):
    """-> [(name, num_warps, num_stages)] of the module's Triton custom calls, in order."""
    calls = []
    for call in module.split(f"@{TRITON}(")[1:]:
        call = re.sub(r'ir = "(?:[^"\\]|\\.)*"', "ir", call, count=1)  # the serialized module
        config = call[:call.index("}")]  # the rest of the backend_config dict
        calls.append((re.search(r'name = "([^"]*)"', config).group(1),
                      int(re.search(r"num_warps = (\d+)", config).group(1)),
                      int(re.search(r"num_stages = (\d+)", config).group(1))))
    return calls


def _hook_owner():
    """-> the module whose attribute HOOK the Triton lowering calls."""
    try:
        registration = importlib.import_module(HOOK_MODULE)
    except ImportError as e:
        raise RuntimeError(f"jax {jax.__version__} has no {HOOK_MODULE}: its Pallas Triton "
                           "lowering moved (or was removed); point triton_ir at the new one") from e
    owner = getattr(registration, "lowering", None)
    if not callable(getattr(owner, HOOK, None)):
        raise RuntimeError(f"jax {jax.__version__}: {HOOK_MODULE}.lowering.{HOOK} is gone; the "
                           "Triton lowering hook moved, point triton_ir at the new one")
    return owner


@contextlib.contextmanager
def _captured(modules):
    """Appends (ttir text, compute capability) of every Triton module jax lowers meanwhile."""
    owner = _hook_owner()
    lower = getattr(owner, HOOK)

    def spy(jaxpr, grid_mapping, platform, compute_capability, *args, **kwargs):
        result = lower(jaxpr, grid_mapping, platform, compute_capability, *args, **kwargs)
        modules.append((result.module.operation.get_asm(), compute_capability))
        return result

    setattr(owner, HOOK, spy)
    try:
        yield
    finally:
        setattr(owner, HOOK, lower)


def triton_kernels(fn, *args, target, donate=()):
    """-> (StableHLO text, [TritonKernel] in launch order) of `fn` exported for GPU `target`."""
    modules = []
    with _captured(modules):
        module = export(fn, *args, target=target, donate=donate)
    calls = triton_calls(module)
    if len(modules) != len(calls):
        raise RuntimeError(f"the export holds {len(calls)} Triton calls but jax {jax.__version__} "
                           f"lowered {len(modules)} through {HOOK}: it no longer lowers every "
                           "kernel there (or cached one); point triton_ir at the new hook")
    return module, [TritonKernel(name, ttir, cc, warps, stages)
                    for (name, warps, stages), (ttir, cc) in zip(calls, modules)]
