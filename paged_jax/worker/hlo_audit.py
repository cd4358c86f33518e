"""What a compiled program does with the arrays that must never move: the KV pages and the stacked
layer weights. Read from XLA's optimized HLO text (`compiled.as_text()`, every computation, fused
ones included) and its memory analysis, so a check holds for what runs, not for what was traced.

A copy of such an array shows up as a `copy`, `transpose` or `convert` (a copy in another dtype:
XLA:CPU upcasts bf16 weights for its dots) with as many elements as it (XLA
changes the shape around it: `f32[30,1,1536,576]` for a `[30,1536,576]` weight, so elements are
compared, not shapes); a full-size temporary shows up in the temp bytes, which `temp_bytes` reads.
A layer's slice of a stacked weight copied into a buffer of its own shows up as a `dynamic-slice`
of that slice's size outside XLA:GPU's dynamic-slice fusions (`copied_layer_slices`)."""
from __future__ import annotations

import dataclasses
import math
import re

import jax

# `%name = f32[3,9810,16,64]{3,2,1,0} copy(...)`: an array result (tuples and scalars aside)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<dtype>\w+)\[(?P<dims>[\d,]*)\]\S* "
                          r"(?P<opcode>[\w\-]+)\(")
MOVING_OPCODES = ("copy", "transpose", "convert")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self):
        return f"%{self.name} = {self.dtype}[{','.join(map(str, self.shape))}] {self.opcode}"


def instructions(hlo_text: str) -> list[Instruction]:
    """Every instruction of the module with an array result, in text order."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            dims = tuple(int(d) for d in m["dims"].split(",") if d)
            out.append(Instruction(m["name"], m["opcode"], m["dtype"], dims))
    return out


def guarded_sizes(tree, min_size: int = 1 << 20) -> dict[int, str]:
    """Element count -> a name, for every array leaf of `tree` (the cache, the weights) of at least
    `min_size` elements: a small one (a norm's [hidden]) shares its count with activations."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {math.prod(leaf.shape): jax.tree_util.keystr(path) for path, leaf in leaves
            if math.prod(leaf.shape) >= min_size}


def moved_arrays(compiled, guarded: dict[int, str]) -> list[str]:
    """The copies, transposes and converts in `compiled` as large as a guarded array, each named with it."""
    return [f"{ins} (as large as {guarded[ins.size]})" for ins in instructions(compiled.as_text())
            if ins.opcode in MOVING_OPCODES and ins.size in guarded]


def temp_bytes(compiled) -> int:
    """XLA's temp buffers for the program: what it allocates beyond its arguments and outputs."""
    return int(compiled.memory_analysis().temp_size_in_bytes)


def layer_slice_sizes(shapes: dict[str, tuple], num_layers: int, min_size: int = 1 << 20) -> dict[int, str]:
    """Element count of one layer's slice -> its name, for each stacked weight's shape
    [num_layers, ...] (on one device) of at least `min_size` elements a layer."""
    sizes = {}
    for name, shape in shapes.items():
        if shape[0] == num_layers and math.prod(shape) // num_layers >= min_size:
            size = math.prod(shape) // num_layers
            sizes[size] = f"{sizes[size]} or {name}" if size in sizes else name
    return sizes


# `%fusion.3 = ... fusion(...), kind=kCustom, calls=%fused_computation.3`
_FUSION = re.compile(r"= .* fusion\(.*kind=(?P<kind>\w+).*calls=%(?P<calls>[\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) ")


def copied_layer_slices(hlo_text: str, slice_sizes: dict[int, str]) -> list[str]:
    """The `dynamic-slice`s in XLA:GPU's optimized HLO as large as one layer's slice of a stacked
    weight whose result is written to memory: unfused, or a fusion's output (a root, or in its root
    tuple), unless the fusion is a `kCustom` one (XLA's dynamic-slice fusion, whose library call
    reads the slice where it lies). A slice fused into its reader (a reduction) reads in place."""
    lines = hlo_text.splitlines()
    fusions = {m["calls"]: m["kind"] for m in map(_FUSION.search, lines) if m}
    owner, slices, roots = None, [], {}
    for line in lines:
        computation = _COMPUTATION.match(line)
        if computation:
            owner = computation["name"]
            continue
        if line.lstrip().startswith("ROOT "):  # the root, or each element of a root tuple
            root, rest = line.split()[1][1:], line.split("=", 1)[1]
            elements = rest.split(" tuple(", 1)[1] if " tuple(" in rest else ""
            roots[owner] = set(re.findall(r"%([\w.\-]+)", elements)) or {root}
        ins = _INSTRUCTION.match(line)
        if ins and ins["opcode"] == "dynamic-slice":
            size = math.prod(int(d) for d in ins["dims"].split(",") if d)
            if size in slice_sizes:
                slices.append((owner, ins["name"], slice_sizes[size]))
    return [f"%{name} in %{owner} (a layer of {weight})" for owner, name, weight in slices
            if owner not in fusions or (fusions[owner] != "kCustom" and name in roots.get(owner, ()))]
