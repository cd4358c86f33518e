"""scripts/gpu_tests.py, the gpu-marked tests' runner on a lent GPU: each failure in a fresh process
(a faulting kernel poisons the CUDA context for every later test in it), run here over a fake
checkout whose tests fault, fail and kill their process."""
import importlib.util
import os
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_tests.py")
FAKE_TESTS = '''
import os
import pytest

@pytest.mark.gpu
def test_a():
    pass

@pytest.mark.gpu
def test_b():
    raise RuntimeError("INTERNAL: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned address")

@pytest.mark.gpu
@pytest.mark.parametrize("x", [1, 2])
def test_c(x):
    assert x == 1

@pytest.mark.gpu
def test_d():
    os._exit(3)

@pytest.mark.gpu
def test_e():
    pass

def test_not_gpu():
    raise AssertionError("not a gpu test: never selected")
'''


def test_each_failure_runs_alone_and_the_rest_go_on(tmp_path, capsys, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake.py").write_text(FAKE_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: fake\n")
    spec = importlib.util.spec_from_file_location("gpu_tests", SCRIPT)
    gpu_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_tests)
    monkeypatch.setattr(gpu_tests, "ROOT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["gpu_tests.py", "--log-dir", str(tmp_path / "logs"),
                                      "--budget", "120"])
    try:
        gpu_tests.main()
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr().out
    assert status == 1
    lines = out.splitlines()
    assert lines[2].startswith("    E ") and lines[2].endswith("assert 2 == 1")  # the failure's E lines
    assert lines[:2] + lines[3:] == [
        "FAILED tests/test_fake.py::test_b  [device fault: CUDA_ERROR_MISALIGNED_ADDRESS]",
        "FAILED tests/test_fake.py::test_c[2]",
        "FAILED tests/test_fake.py::test_d",
        "3 passed, 3 failed",  # test_a, test_c[1], test_e: each run once
    ]
    # four rounds: each after a failure goes on without the tests already run
    assert sorted(os.listdir(tmp_path / "logs")) == [f"round{i}.log" for i in range(1, 5)]
