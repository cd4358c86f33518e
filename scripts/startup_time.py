"""How long the server takes to start: `python -m paged_jax.serve` launched, then the seconds until
its port listens, until a completion sent at that moment is answered, and until /health is 200
(the background warm-up done). Run twice with one cache directory: the first start is cold, the
second reads the compiled programs from jax's persistent compilation cache.

    python scripts/startup_time.py --model SmolLM2-135M-Instruct.Q4_1.gguf --cache-dir /tmp/pjc --runs 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.ports import free_port  # noqa: E402


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def one_start(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "paged_jax.serve", "--port", str(port), "--uvicorn-log-level", "warning",
           "--compilation-cache-dir", args.cache_dir, *(["--model", args.model] if args.model else [])]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        while health(url) is None:
            if proc.poll() is not None:
                raise SystemExit("".join(lines))
            time.sleep(0.05)
        listening = time.monotonic() - start
        answered = {}

        def ask():
            body = json.dumps({"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}).encode()
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as r:
                answered["text"] = json.loads(r.read())["choices"][0]["text"]
            answered["s"] = time.monotonic() - start

        asker = threading.Thread(target=ask)
        asker.start()
        while health(url) != 200:
            time.sleep(0.1)
        healthy = time.monotonic() - start
        asker.join()
    finally:
        proc.terminate()
        proc.wait(60)
    warm_up = next((line.strip() for line in lines if "warm-up" in line), "")
    return dict(listening=listening, first_answer=answered["s"], healthy=healthy, text=answered["text"], warm_up=warm_up)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the embedded model)")
    ap.add_argument("--cache-dir", required=True, help="jax's persistent compilation cache (empty: a cold start)")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    for i in range(args.runs):
        r = one_start(args)
        print(f"start {i + 1}: listening {r['listening']:.1f} s, first answer {r['first_answer']:.1f} s, "
              f"/health 200 {r['healthy']:.1f} s; {r['warm_up']}; answer {r['text']!r}", flush=True)


if __name__ == "__main__":
    main()
