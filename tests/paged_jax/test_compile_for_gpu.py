"""The engine compiled for an H100, H200 and A100 without a GPU (scripts/compile_for_gpu.py): real
models' configs (tests/data/configs, no weights) at GPU defaults, each run in its own process (an
architecture mismatch aborts one). Compiled figures are cached by the lowered program's hash
(gpu_compile.CACHE_DIR), so a run whose programs did not change only traces and lowers; cold, the
CI set compiles for about 20 minutes of one worker. Needs the gpu-compile extra (line 2g of
scripts/test.sh); skipped where the CUDA plugin is not installed. `-m slow`: every program bucket,
and Llama-3.1-8B over 8 GPUs."""
import json
import os
import subprocess
import sys

import pytest

from pallas_kernels import gpu_target, mosaic

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs pip install -e '.[gpu-compile]'")
pytestmark = pytest.mark.timeout(1800)  # a cold cache compiles Llama-3.1-8B's programs for minutes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "tests", "data", "configs")
MOSAIC = "pallas_mosaic" if mosaic.AVAILABLE else "pallas"  # "auto" on Hopper: Mosaic GPU from jax 0.12
TRITON = pytest.mark.triton  # the script's process imports Pallas Triton even where tests hide it
UTILIZATION = 0.9  # vLLM's gpu_memory_utilization default, of jax's allocator limit


def compile_for_gpu(tmp_path, gpu, model, *flags):
    """Run the script in its own process -> (exit status, its JSON figures or None, stderr)."""
    out = tmp_path / f"{gpu}-{model}.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_for_gpu.py"), "--gpu", gpu,
                           "--model", os.path.join(CONFIGS, model + ".json"), "--json", str(out), *flags],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=1700)
    return done.returncode, json.loads(out.read_text()) if out.exists() else None, done.stderr


def parameter_count(model):
    """Weights of an HF config, counted from its fields (not from our model code)."""
    hf = json.load(open(os.path.join(CONFIGS, model + ".json")))
    hidden, inter, vocab, layers = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    norms = {"llama": 2 * hidden, "qwen3": 2 * hidden + 2 * head_dim, "gemma2": 4 * hidden,
             "gemma3_text": 4 * hidden + 2 * head_dim}[hf["model_type"]]
    per_layer = attention + 3 * hidden * inter + norms
    return vocab * hidden * (1 if hf.get("tie_word_embeddings", True) else 2) + hidden \
        + layers * per_layer


def kv_bytes_per_block(model, block_size=16, page_bytes=2, scale_bytes=0):
    hf = json.load(open(os.path.join(CONFIGS, model + ".json")))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * block_size * (head_dim * page_bytes + scale_bytes)


LAYER_LOOP = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from models import layers
from pallas_kernels import gpu_target
from paged_jax.worker import hlo_audit
device = gpu_target.compile_only_device("h100")
placed = NamedSharding(Mesh([device], ("x",)), P())
L, H, F = 4, 1024, 4096
up = jax.ShapeDtypeStruct((L, H, F), jnp.bfloat16, sharding=placed)
down = jax.ShapeDtypeStruct((L, F, H), jnp.bfloat16, sharding=placed)
x = jax.ShapeDtypeStruct((8, H), jnp.bfloat16, sharding=placed)

def mlps(x, up, down):
    def layer(i, x):
        u, d = (jax.lax.dynamic_index_in_dim(w, i, keepdims=False) for w in (up, down))
        return x + jax.nn.silu(x @ u) @ d
    return jax.lax.fori_loop(0, L, layer, x)

sizes = hlo_audit.layer_slice_sizes({"up": up.shape, "down": down.shape}, L)
found = {}
for name, options in (("defaults", {}), ("engine", layers.COMPILER_OPTIONS)):
    with jax.default_device(device):
        compiled = jax.jit(mlps, compiler_options=options).trace(x, up, down).lower().compile()
    found[name] = hlo_audit.copied_layer_slices(compiled.as_text(), sizes)
print(json.dumps(found))
"""


def test_layer_loop_reads_weight_slices_in_place():
    """With XLA's defaults, an H100 build of a layer loop copies each layer's slice of the stacked
    weights before its Triton gemms read it (the audit finds both); with the engine's compiler
    options, cuBLAS reads them in place under XLA's dynamic-slice fusion."""
    done = subprocess.run([sys.executable, "-c", LAYER_LOOP], env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found["defaults"]) == 2 and all(line.endswith("(a layer of up or down)") for line in found["defaults"])
    assert found["engine"] == []


def program(figures, prefix):
    return next(p for p in figures["programs"] if p["name"].startswith(prefix))


def check_sized_as_vllm(figures, gpu, model, *, tp=1, page_bytes=2, scale_bytes=0, draft=None, ngram=False,
                        copying=()):
    """The pool holds what gpu_memory_utilization leaves of jax's limit after the weights and the
    largest prefill's temps (or verification's, if larger), capped at what max_num_seqs sequences
    of the model's whole context could use; and weights, pool and every program's temps fit; and no
    program but those named in `copying` copies a layer's weights out of the stacked arrays.
    `draft`: a draft model whose K/V each block holds too; `ngram`: each block holds its slots' token
    ids too (n-gram speculation's token pages, an int32 a slot)."""
    c, hf = figures["config"], json.load(open(os.path.join(CONFIGS, model + ".json")))
    limit = int(gpu_target.gpu_spec(gpu).memory_bytes * 0.75)  # XLA_PYTHON_CLIENT_MEM_FRACTION's default
    assert figures["bytes_limit"] == limit
    assert c["bytes_per_block"] == kv_bytes_per_block(model, page_bytes=page_bytes, scale_bytes=scale_bytes) + (
        kv_bytes_per_block(draft) if draft else 0) + (4 * c["block_size"] if ngram else 0)
    budget = int(UTILIZATION * limit - figures["weight_bytes"] - figures["activation_bytes"])
    useful = c["max_num_seqs"] * -(-hf["max_position_embeddings"] // c["block_size"]) + 1
    assert c["num_blocks"] == min(useful, budget * tp // c["bytes_per_block"])
    assert c["max_model_len"] == min(hf["max_position_embeddings"], (c["num_blocks"] - 1) * c["block_size"])
    assert figures["failed"] == [] and figures["does_not_fit"] is None
    # the layer loop reads each layer's weights where they lie (layers.COMPILER_OPTIONS)
    assert [p["name"] for p in figures["programs"] if p["copied_layer_slices"]] == list(copying)
    temps = max(p["temp_bytes"] for p in figures["programs"])
    assert figures["weight_bytes"] + figures["kv_bytes"] + temps <= limit


@pytest.mark.parametrize("gpu,flags,backend", [
    ("h100", (), MOSAIC),  # what "auto" runs on Hopper
    pytest.param("h100", ("--attention-backend", "pallas_triton"), "pallas", marks=TRITON),
    pytest.param("a100", (), "pallas", marks=TRITON),  # no TMA barriers nor WGMMA: Triton
])
def test_llama_3_1_8b_at_gpu_defaults_compiles_and_fits(tmp_path, gpu, flags, backend):
    status, figures, err = compile_for_gpu(tmp_path, gpu, "llama-3.1-8b", "--programs", "largest", *flags)
    assert status == 0, err[-3000:]
    assert figures["config"]["attention_backend"] == backend
    assert figures["weight_bytes"] == 2 * parameter_count("llama-3.1-8b") == 16_060_522_496
    check_sized_as_vllm(figures, gpu, "llama-3.1-8b")
    c = figures["config"]
    assert (c["max_num_seqs"], c["max_num_batched_tokens"], c["max_model_len"]) == (256, 8192, 131072)
    # the KV pages are donated: the pool's size enters the temps (the probe compiled a 2-block pool)
    # only through the block pool's bookkeeping, a few i32 a block
    difference = program(figures, "prefill T=8192")["temp_bytes"] - figures["activation_bytes"]
    assert 0 <= difference <= 16 * c["num_blocks"]
    assert program(figures, "decode K=8 B=256")["name"] == "decode K=8 B=256 W=8192"  # tables 131072 tokens wide


@pytest.mark.skipif(not mosaic.AVAILABLE, reason=str(mosaic.UNAVAILABLE))
def test_one_row_decode_on_hopper_transposes_no_weights(tmp_path):
    """At one row XLA turns the K/V projections into a multiply and a reduction. While their output
    went to the Triton cache-write kernel, whose operand layout is fixed, XLA transposed the whole
    K and V weight stacks to produce it: 544 MiB of temps for Llama-3.1-8B's one-row decode, half a
    GiB moved every call (the Triton backend still does). Hopper's path writes the cache with XLA's
    scatter, whose layout XLA chooses."""
    status, figures, err = compile_for_gpu(tmp_path, "h100", "llama-3.1-8b", "--programs", "quick")
    assert status == 0, err[-3000:]
    assert figures["config"]["attention_backend"] == "pallas_mosaic"
    assert program(figures, "decode K=8 B=1 W=8192")["temp_bytes"] < 64 * 2**20
    check_sized_as_vllm(figures, "h100", "llama-3.1-8b")


# Gemma 2's layers run in sliding/global pairs, two layers a loop step (Gemma 3's in sixes): in their
# largest prefill XLA fuses the group's slices of an MLP weight into one loop fusion that writes them
# (the dynamic-slice fusion then cannot read them in place); 8192 tokens a step are compute-bound.
# Their decode programs read every slice in place, Gemma 3 1B's two layers past the sixes included.
GEMMA3_COPYING = ("prefill T=8192 B=256 W=2048",)
@pytest.mark.parametrize("gpu,model,backend,copying", [
    ("h100", "smollm2-135m-instruct", MOSAIC, ()), pytest.param("a100", "qwen3-0.6b", "pallas", (), marks=TRITON),
    ("h200", "gemma-2-2b", MOSAIC, ("prefill T=8192 B=256 W=512",)),  # head_dim 64, 128, 256
    ("h100", "gemma-3-1b-it", MOSAIC, GEMMA3_COPYING)])  # six layers a loop step, one KV head
def test_other_families_compile_and_fit(tmp_path, gpu, model, backend, copying):
    status, figures, err = compile_for_gpu(tmp_path, gpu, model, "--programs", "largest")
    assert status == 0, err[-3000:]
    assert figures["config"]["attention_backend"] == backend
    assert figures["weight_bytes"] == 2 * parameter_count(model)
    check_sized_as_vllm(figures, gpu, model, copying=copying)


@pytest.mark.skipif(not mosaic.AVAILABLE, reason=str(mosaic.UNAVAILABLE))
def test_blackwell_programs_compile_on_mosaic_gpu(tmp_path):
    """B200 with the tcgen05 kernel forced ("auto" keeps Triton there while jax ships it): decode
    pads to 128-row tiles and ragged tiles hold 128 // G tokens, inside the engine's programs."""
    status, figures, err = compile_for_gpu(tmp_path, "b200", "qwen3-0.6b", "--programs", "largest",
                                           "--attention-backend", "pallas_mosaic")
    assert status == 0, err[-3000:]
    assert figures["config"]["attention_backend"] == "pallas_mosaic"
    check_sized_as_vllm(figures, "b200", "qwen3-0.6b")


@pytest.mark.parametrize("model,spec,verify", [
    ("smollm2-135m-instruct", {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
                               "prompt_lookup_max": 4}, "verify ngram k=7 T=2048 B=256 W=512"),
    ("qwen3-0.6b", {"method": "draft_model", "model": os.path.join(CONFIGS, "qwen2.5-0.5b.json"),
                    "num_speculative_tokens": 4}, "verify draft k=4 T=2048 B=256 W=2560")])
def test_speculative_decoding_compiles_and_fits(tmp_path, model, spec, verify):
    """Every step of an engine that speculates carries its proposer's state (n-gram's token pages,
    or the draft's pages and weights), and its largest verification compiles too."""
    status, figures, err = compile_for_gpu(tmp_path, "h100", model, "--programs", "largest",
                                           "--speculative-config", json.dumps(spec))
    assert status == 0, err[-3000:]
    assert [p["name"] for p in figures["programs"]][2] == verify
    check_sized_as_vllm(figures, "h100", model, draft="qwen2.5-0.5b" if "model" in spec else None,
                        ngram=spec["method"] == "ngram")


def test_lora_slots_compile_and_fit(tmp_path):
    """enable_lora with 4 slots of rank 16 on Llama-3.1-8B for an H100: every program carries the
    slots, their bytes (counted here from the HF config) come out of the KV budget, and the layer
    loop still reads each layer's weights in place beside the slots sliced with them."""
    status, figures, err = compile_for_gpu(tmp_path, "h100", "llama-3.1-8b", "--programs", "largest",
                                           "--max-loras", "4", "--max-lora-rank", "16")
    assert status == 0, err[-3000:]
    hf = json.load(open(os.path.join(CONFIGS, "llama-3.1-8b.json")))
    h, f, hd = hf["hidden_size"], hf["intermediate_size"], hf["hidden_size"] // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    features = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + f)  # in + out of q, k, v, o, gate, up, down
    slots = hf["num_hidden_layers"] * 4 * 16 * 2 * features  # bf16
    assert figures["config"]["lora"]["nbytes"] == slots == 320 * 2**20
    assert figures["weight_bytes"] == 2 * parameter_count("llama-3.1-8b") + slots
    check_sized_as_vllm(figures, "h100", "llama-3.1-8b")


@pytest.mark.parametrize("kv_cache_dtype,page_bytes", [("int8", 1), ("fp8_e4m3", 1)])
def test_quantized_kv_compiles_for_h100(tmp_path, kv_cache_dtype, page_bytes):
    status, figures, err = compile_for_gpu(tmp_path, "h100", "qwen3-0.6b", "--programs", "largest",
                                           "--kv-cache-dtype", kv_cache_dtype)
    assert status == 0, err[-3000:]
    check_sized_as_vllm(figures, "h100", "qwen3-0.6b", page_bytes=page_bytes, scale_bytes=4)  # f32 scale a token-head


@TRITON
def test_fp8_kv_is_refused_by_name_for_a100(tmp_path):
    status, figures, err = compile_for_gpu(tmp_path, "a100", "qwen3-0.6b", "--kv-cache-dtype", "fp8_e4m3")
    assert status != 0 and figures is None
    assert "kv_cache_dtype 'fp8_e4m3' cannot be read by attention backend 'pallas' on sm_80" in err


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallel_compiles_over_compile_only_devices(tmp_path, tp):
    status, figures, err = compile_for_gpu(tmp_path, "h100", "qwen3-0.6b", "--programs", "largest",
                                           "--tensor-parallel-size", str(tp))
    assert status == 0, err[-3000:]
    check_sized_as_vllm(figures, "h100", "qwen3-0.6b", tp=tp)
    assert figures["weight_bytes"] * tp >= 2 * parameter_count("qwen3-0.6b")  # norms are on every device
    # 16 query heads, 8 KV heads, MLP columns and the vocabulary (tied) split tp ways
    assert figures["kv_bytes"] == figures["config"]["num_blocks"] * figures["config"]["bytes_per_block"] // tp


def test_a_batch_that_cannot_fit_fails_naming_the_program_and_bytes(tmp_path):
    status, figures, err = compile_for_gpu(tmp_path, "h100", "llama-3.1-8b", "--programs", "largest",
                                           "--max-num-batched-tokens", str(1 << 20))
    assert status == 1 and figures is None
    assert "does not fit: prefill T=1048576 B=256 W=8192 needs " in err
    temp = int(err.split("W=8192 needs ")[1].split()[0])
    assert temp > 0.9 * int(gpu_target.gpu_spec("h100").memory_bytes * 0.75) - 2 * parameter_count("llama-3.1-8b")


@pytest.mark.slow
@pytest.mark.parametrize("gpu", gpu_target.GPUS)
def test_every_program_of_llama_3_1_8b(tmp_path, gpu):
    status, figures, err = compile_for_gpu(tmp_path, gpu, "llama-3.1-8b")
    assert status == 0, err[-3000:]
    check_sized_as_vllm(figures, gpu, "llama-3.1-8b")
    assert len(figures["programs"]) == 10 + 9 + 5 + 5  # token buckets, row buckets, variants, pool ops


@pytest.mark.slow
def test_llama_3_1_8b_over_8_gpus(tmp_path):
    status, figures, err = compile_for_gpu(tmp_path, "h100", "llama-3.1-8b", "--programs", "largest",
                                           "--tensor-parallel-size", "8")
    assert status == 0, err[-3000:]
    check_sized_as_vllm(figures, "h100", "llama-3.1-8b", tp=8)
