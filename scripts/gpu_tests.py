"""The gpu-marked tests on a lent GPU, each failure isolated: a kernel that faults (a misaligned
or out-of-bounds access) poisons the process's CUDA context, and every later test in it fails for
no fault of its own. So pytest runs with -x, and after each failure a fresh process goes on without
the failed tests; the first test that faulted the device runs again under compute-sanitizer, which
names the kernel and the access.

    python scripts/gpu_tests.py [--log-dir DIR] [--budget SECONDS] [-k EXPRESSION]

Only the files that hold gpu-marked tests are collected (the rest need the whole test extra).
Exit status 0 when every test passed."""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FAULT = re.compile(r"CUDA_ERROR_\w+|cudaError\w+|an illegal memory access")


def gpu_test_files():
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True))
    return [os.path.relpath(f, ROOT) for f in files if "mark.gpu" in open(f).read()]


def run_round(files, done, log_path, timeout, keyword=None):
    """One pytest process over `files` without the `done` ids (passed or failed), stopped at its
    first failure. -> (status, the failed test's id or None, its log); status None: out of time."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-x", "-m", "gpu", "-p", "no:cacheprovider",
           "-rf", *(["-k", keyword] if keyword else []), *files,
           *(f"--deselect={t}" for t in done)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        log, status = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, status = (e.stdout or b"").decode(errors="replace") + "\n[out of time]", None
    with open(log_path, "w") as f:
        f.write(log)
    ids = re.findall(r"^FAILED (\S+)", log, re.M)
    if not ids and status is not None:  # it died inside a test: -v printed its id before the result
        ids = re.findall(r"^(tests/\S+::\S+)(?: |$)(?!.*(?:PASSED|SKIPPED|XFAIL))", log, re.M)[-1:]
    return status, (ids[0] if ids else None), log


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--log-dir", default="gpu_tests")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds for all rounds together")
    ap.add_argument("-k", dest="keyword", help="only the tests pytest -k selects")
    args = ap.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    files, failed, faulted = gpu_test_files(), [], None
    deadline = time.monotonic() + args.budget
    passed = set()
    for round_no in range(1, 100):
        left = deadline - time.monotonic()
        if left < 10:
            print(f"out of time after {round_no - 1} rounds")
            failed.append("(not run)")
            break
        status, test, log = run_round(files, passed | set(failed),
                                      f"{args.log_dir}/round{round_no}.log", left, args.keyword)
        passed.update(re.findall(r"^(tests/\S+) PASSED", log, re.M))
        if status is None:
            print(f"out of time in round {round_no}: the tests after the last that passed did not run")
            failed.append("(not run)")
            break
        if status == 0 or test is None:
            if status not in (0, 5):  # 5: nothing left to run
                tail = log.strip().splitlines()[-1] if log.strip() else ""
                print(f"round {round_no}: exit status {status}, no failed test named: {tail}")
                failed.append("(unnamed)")
            break
        fault = FAULT.search(log)
        lines = [ln for ln in log.splitlines() if ln.startswith("E ") and not FAULT.search(ln)]
        print(f"FAILED {test}" + (f"  [device fault: {fault.group(0)}]" if fault else ""))
        for ln in lines[:6]:
            print("    " + ln[:240])
        failed.append(test)
        if fault and faulted is None:
            faulted = test
    print(f"{len(passed)} passed, {len(failed)} failed")
    sanitizer = shutil.which("compute-sanitizer")
    if faulted and sanitizer and deadline - time.monotonic() > 30:
        print(f"compute-sanitizer memcheck on {faulted}:")
        try:
            proc = subprocess.run(
                [sanitizer, "--tool", "memcheck", "--print-limit", "4", sys.executable, "-m",
                 "pytest", "-q", "-x", "-p", "no:cacheprovider", faulted],
                cwd=ROOT, capture_output=True, text=True, timeout=deadline - time.monotonic())
            report = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            report = (e.stdout or b"").decode(errors="replace") + "\n[timed out]"
        with open(f"{args.log_dir}/sanitizer.log", "w") as f:
            f.write(report)
        for ln in [ln for ln in report.splitlines() if ln.startswith("========= ")][:40]:
            print("    " + ln[:240])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
