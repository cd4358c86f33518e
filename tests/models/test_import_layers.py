"""models/ imports one way: each module imports the ones below it at module level, never inside a
function (the circle checkpoint -> gguf -> gguf_tokenizer -> tokenizer -> gguf was held together
that way), never another file's private name, and importing the models does not load the engine."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
ENGINE_MODULES = ("paged_jax.engine", "paged_jax.entrypoints", "paged_jax.worker.model_runner",
                  "paged_jax.core.scheduler")


def _module(file: Path) -> str:
    return "models" if file.name == "__init__.py" else f"models.{file.stem}"


def _imports(file: Path):
    """(node, imported models module, names, inside a function) for every import of models.*."""
    tree = ast.parse(file.read_text(), filename=str(file))
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "models":
            if node.module == "models":  # `from models import gguf` names a module, `import Llama` a name
                for alias in node.names:
                    sub = f"models.{alias.name}"
                    found = (MODELS / f"{alias.name}.py").is_file()
                    yield node, sub if found else "models", [] if found else [alias.name], id(node) in in_function
            else:
                yield node, node.module, [a.name for a in node.names], id(node) in in_function
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "models":
                    yield node, alias.name, [], id(node) in in_function


def test_import_models_does_not_load_the_engine():
    code = ("import sys, models, models.gguf, models.tokenizer, models.checkpoint; "
            f"print(sorted(m for m in sys.modules if m.startswith({ENGINE_MODULES!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_models_import_one_way():
    files = sorted(MODELS.glob("*.py"))
    in_functions, private, graph = [], [], {}
    for file in files:
        here = _module(file)
        graph[here] = set()
        for node, module, names, in_function in _imports(file):
            where = f"{file.name}:{node.lineno} {module}"
            if in_function:
                in_functions.append(where)
            else:
                graph[here].add(module)
            private += [f"{where}.{n}" for n in names if n.startswith("_")]
    assert in_functions == []
    assert private == []
    # Below the package's __init__ (which imports every module to export its names), no module
    # imports the package itself, and the module-level imports have no cycle: peel off the modules
    # whose imports are all peeled until none is left.
    assert sorted(m for m, deps in graph.items() if m != "models" and "models" in deps) == []
    layers, done = [], set()
    while len(done) < len(graph):
        ready = sorted(m for m, deps in graph.items() if m not in done and deps & set(graph) <= done)
        assert ready, f"import cycle among {sorted(set(graph) - done)}"
        layers.append(ready)
        done.update(ready)
    # The bottom: the error and the GGUF reader import no other models module (the tokenizer and
    # the model loader both build on them); the package is the top.
    assert graph["models.errors"] == set() and graph["models.gguf_file"] == {"models.errors"}
    assert layers[-1] == ["models"]
