"""LoRA adapters over HTTP (`--enable-lora --lora-modules`): a client names an adapter as its model,
as with vLLM's server; outputs equal `LLM.generate` with the same LoRARequest."""
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from models.checkpoint import read_config  # noqa: E402
from paged_jax import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.models.model_testing import save_peft_adapter  # noqa: E402
from tests.paged_jax.test_openai_server import MODEL, ROOT, Server  # noqa: E402

PROMPT = "def fibonacci(n):\n"
ENGINE = dict(max_num_seqs=4, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    config = read_config(MODEL)
    save_peft_adapter(tmp / "one", config, rank=8, alpha=16, seed=1)
    save_peft_adapter(tmp / "two", config, rank=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "o_proj"))
    return tmp, [LoRARequest("one", 1, str(tmp / "one")), LoRARequest("two", 2, str(tmp / "two"))]


@pytest.fixture(scope="module")
def server(adapters):
    tmp, _ = adapters
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    s = Server(tmp, "--enable-lora", "--allow-runtime-lora-updating", *flags, "--lora-modules",
               f"one={tmp / 'one'}", json.dumps({"name": "two", "path": str(tmp / "two")}))
    try:
        yield s.wait()
    finally:
        s.stop()


def test_a_request_names_its_adapter_as_its_model(server, adapters):
    _, loras = adapters
    reference = LLM(str(MODEL), log_stats=False, enable_lora=True, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    want = [o.outputs[0].text for o in reference.generate([PROMPT] * 3, params, lora_request=[None, *loras])]
    assert len(set(want)) == 3  # each adapter changes the completion
    for model, text in zip(["embedded", "one", "two"], want):
        status, body = server.post("/v1/completions", json.dumps(
            {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode())
        assert status == 200 and body["model"] == model and body["choices"][0]["text"] == text, (model, body)
    status, body = server.post("/v1/completions", json.dumps({"model": "three", "prompt": PROMPT}).encode())
    assert status == 404 and body["error"]["message"] == "The model `three` does not exist."
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
        cards = json.loads(r.read())["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("embedded", None), ("one", "embedded"), ("two", "embedded")]
    assert cards[2]["root"] == loras[1].lora_path


def post(server, path, body):
    """-> (status, body text) of a POST whose answer may be plain text."""
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_adapters_are_added_and_removed_while_serving(server, adapters, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: an added name serves its adapter
    (here adapter one's directory under a new name: the same completion), a removed one is gone."""
    tmp, _ = adapters
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    _, one = server.post("/v1/completions", json.dumps({**body, "model": "one"}).encode())
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "three", "lora_path": str(tmp / "one")}) == (
        200, "Success: LoRA adapter 'three' added successfully.")
    status, three = server.post("/v1/completions", json.dumps({**body, "model": "three"}).encode())
    assert status == 200 and three["choices"][0]["text"] == one["choices"][0]["text"]
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
        assert [c["id"] for c in json.loads(r.read())["data"]] == ["embedded", "one", "two", "three"]
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "three", "lora_path": str(tmp / "two")})
    assert status == 400 and "The lora adapter 'three' has already been loaded." in text
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "four", "lora_path": str(tmp_path)})
    assert status == 400 and f"LoRA adapter '{tmp_path}': no adapter_config.json" in text
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "four"})
    assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "three"}) == (
        200, "Success: LoRA adapter 'three' removed successfully.")
    status, body = server.post("/v1/completions", json.dumps({**body, "model": "three"}).encode())
    assert status == 404 and body["error"]["message"] == "The model `three` does not exist."
    status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "three"})
    assert status == 404 and "The lora adapter 'three' cannot be found." in text


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "one=/nowhere"], "--lora-modules needs --enable-lora"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "one"], "--lora-modules: 'one' is not NAME=PATH"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules: the name 'a' is given twice"),
    (["--enable-lora", "--lora-modules", "gone=/nowhere/gone"], "LoRA adapter '/nowhere/gone': no adapter_config.json"),
])
def test_bad_flags_stop_the_server_with_the_reason(flags, message):
    run = subprocess.run([sys.executable, "-m", "paged_jax.serve", "--no-compilation-cache", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode != 0 and message in run.stderr, run.stderr
