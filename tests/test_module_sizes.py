"""Every module of the library (the packages pyproject.toml installs) stays under 300 lines: one a
reader can hold whole (issue 24)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("paged_jax", "pallas_kernels", "models")


def test_no_library_module_is_over_300_lines():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    assert len(sizes) > 60
    assert {path: n for path, n in sizes.items() if n > 300} == {}
