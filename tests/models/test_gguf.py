"""models.gguf on small files written here: every supported quant type dequantizes to what ggml's
reference decoder gives (tests/models/ggml_blocks.py), an unsupported one is refused by tensor and
type, and tiny Llama / Qwen2 / Qwen3 files written as llama.cpp writes them (q/k rows permuted for a
Llama) load to exactly the model they were written from, through `LLM("file.gguf")` too."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ggml_blocks import BLOCKS, decode, random_blocks
from gguf_testing import Q, hf_state, permute, save_hf_dir, write_gguf
from model_testing import LLAMA3_SCALING, dense_logits, max_rel_err, random_model, tiny_config
from models import gguf as G
from models.checkpoint import CheckpointError, load_model
from paged_jax import LLM, SamplingParams

KINDS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS")
FAMILIES = {"llama": dict(), "llama_tied": dict(tie_word_embeddings=True),
            # Qwen2: q/k/v biases, tied; Qwen3: q/k norms over a head_dim (32) that is not hidden / heads.
            "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
            "qwen3": dict(model_type="qwen3", head_dim=32),
            # Llama 3.2's RoPE scaling (factor 32): head_dim 16 has short, blended and long wavelengths.
            "llama3_rope": dict(rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=8192))}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 7, 120], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def pure(model):
    """The model's parameters as nested dicts of numpy arrays."""
    return as_numpy(nnx.to_pure_dict(nnx.state(model)))


def as_numpy(tree):
    return {k: as_numpy(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


def cast(tree, dtype):
    return {k: cast(v, dtype) if isinstance(v, dict) else v.astype(dtype) for k, v in tree.items()}


def assert_same_params(actual, expected, path=()):
    assert actual.keys() == expected.keys(), path
    for key in expected:
        if isinstance(expected[key], dict):
            assert_same_params(actual[key], expected[key], path + (key,))
        else:
            np.testing.assert_array_equal(actual[key], expected[key], err_msg=str(path + (key,)))


def blocks_file(tmp_path, kinds, rows=3, blocks_per_row=2):
    """A GGUF of one tensor per kind, random raw blocks (random values for F32/F16/BF16) -> (reader,
    {kind: the raw bytes u8[rows, bytes_per_row]})."""
    rng = np.random.default_rng(0)
    writer = G.gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "llama")
    raws = {}
    for kind in kinds:
        if kind in ("F32", "F16", "BF16"):
            values = rng.standard_normal((rows, 32 * blocks_per_row)).astype(np.float32)
            data = values.astype(np.float16) if kind == "F16" else values
            raws[kind] = data.view(np.uint8) if kind != "BF16" else G.gguf.quants.quantize(values, Q.BF16)
            writer.add_tensor(f"t.{kind}", data if kind != "BF16" else raws[kind],
                              raw_dtype=Q.BF16 if kind == "BF16" else None)
        else:
            raws[kind] = random_blocks(kind, rng, rows, blocks_per_row)
            writer.add_tensor(f"t.{kind}", raws[kind], raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return G.open_gguf(tmp_path / "blocks.gguf"), raws


def test_every_supported_type_dequantizes_as_ggml_reference(tmp_path):
    reader, raws = blocks_file(tmp_path, KINDS)
    assert [t.tensor_type.name for t in reader.tensors] == list(KINDS)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        values = G.dequantize(tensor)
        per_block = BLOCKS.get(kind, (32, None))[0]
        assert values.dtype == np.float32 and values.shape == (3, 2 * per_block), kind
        np.testing.assert_array_equal(values, decode(kind, raws[kind]), err_msg=kind)
        assert np.isfinite(values).all() and np.abs(values).max() > 0, kind


@pytest.mark.parametrize("kind", ["IQ2_XXS", "IQ3_XXS"])
def test_an_unsupported_type_names_the_tensor_and_the_type(tmp_path, kind):
    reader, _ = blocks_file(tmp_path, [kind], blocks_per_row=1)
    with pytest.raises(ValueError, match=rf"tensor 't\.{kind}' has type {kind}, which is not supported; "
                                         r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, "
                                         r"Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
        G.dequantize(reader.tensors[0])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_float32_file_loads_to_the_model_it_was_written_from(tmp_path, family):
    model = random_model(tiny_config(vocab_size=256, **FAMILIES[family]))
    write_gguf(tmp_path / "m.gguf", model)
    reader = G.open_gguf(tmp_path / "m.gguf")
    if family.startswith("llama"):  # the file's q/k rows really are llama.cpp's, not HF's
        stored = G.dequantize(next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight"))
        expected = hf_state(model)["model.layers.0.self_attn.k_proj.weight"]
        assert not np.array_equal(stored, expected)
        np.testing.assert_array_equal(stored, permute(expected, model.config.num_kv_heads))
    loaded = load_model(tmp_path / "m.gguf")
    assert loaded.config == model.config
    assert_same_params(pure(loaded), pure(model))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_reading_the_same_file(tmp_path, family):
    """transformers' own GGUF reader (its config mapping, its q/k un-permute) on the file we load."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    # transformers' qwen3 GGUF mapping ignores attention.key_length: its head_dim is Qwen3Config's 128.
    extra = dict(hidden_size=512, num_heads=4, head_dim=128) if family == "qwen3" else {}
    model = random_model(tiny_config(vocab_size=256, **{**FAMILIES[family], **extra}))
    write_gguf(tmp_path / "m.gguf", model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").eval()
    with torch.no_grad():
        expected = hf(torch.tensor(PROMPTS[1])[None]).logits[0].numpy()
    actual = dense_logits(load_model(tmp_path / "m.gguf"), jnp.asarray(PROMPTS[1])[None])[0]
    assert max_rel_err(actual, expected) <= 1e-5


# Gemma 3's sliding layers turn at llama.cpp's fixed base (a file does not carry it), its global
# ones at the file's, slowed by the linear factor its 4B-27B files give.
GEMMA_FILES = {"gemma2": dict(model_type="gemma2", query_pre_attn_scalar=32, sliding_window=8),
               "gemma3": dict(model_type="gemma3_text", num_layers=7, query_pre_attn_scalar=32, sliding_window=8,
                              rope_theta=1e6, rope_linear_factor=8.0)}


@pytest.mark.parametrize("family, depth_27b", [("gemma2", 46), ("gemma3", 62)])
def test_a_gemma_file_loads_to_the_model_it_was_written_from(tmp_path, family, depth_27b):
    """Gemma 2 and 3 as llama.cpp writes them: each norm as its (1 + w) scale (Gemma 3's q and k norms
    too), the four norms of a layer under llama.cpp's names, the soft caps, window and RoPE scaling in
    the metadata. The file loads to a safetensors copy of what it holds exactly (each norm w + 1 - 1
    in f32) and to the model it came from within that rounding, logits and greedy tokens through a
    window the prompt outgrows."""
    config = tiny_config(vocab_size=256, head_dim=32, **GEMMA_FILES[family])
    model = random_model(config)
    meant = write_gguf(tmp_path / "m.gguf", model)
    reader = G.open_gguf(tmp_path / "m.gguf")
    stored = {t.name: t for t in reader.tensors}
    hf = hf_state(model)
    np.testing.assert_array_equal(G.dequantize(stored["blk.1.ffn_norm.weight"]),
                                  hf["model.layers.1.pre_feedforward_layernorm.weight"] + 1)
    if family == "gemma3":
        np.testing.assert_array_equal(G.dequantize(stored["blk.1.attn_q_norm.weight"]),
                                      hf["model.layers.1.self_attn.q_norm.weight"] + 1)
    loaded, copy = load_model(tmp_path / "m.gguf"), load_model(save_hf_dir(tmp_path / "ref", config, meant))
    assert loaded.config == model.config
    assert_same_params(pure(loaded), pure(copy))
    tokens = jnp.asarray(PROMPTS[1])[None]
    np.testing.assert_array_equal(dense_logits(loaded, tokens), dense_logits(copy, tokens))
    assert max_rel_err(dense_logits(loaded, tokens), dense_logits(model, tokens)) <= 1e-5
    kw = dict(block_size=8, num_blocks=32, max_num_seqs=2, max_model_len=64, log_stats=False)
    greedy = [o.outputs[0].token_ids for o in LLM(str(tmp_path / "m.gguf"), **kw).generate(PROMPTS, GREEDY)]
    assert greedy == [o.outputs[0].token_ids for o in LLM(model, **kw).generate(PROMPTS, GREEDY)]
    # The 27B scales scores by (hidden / heads) ** -1/2, the others by head_dim ** -1/2.
    deep = random_model(tiny_config(vocab_size=256, head_dim=32, **{
        **GEMMA_FILES[family], "query_pre_attn_scalar": 16, "num_layers": depth_27b}))
    write_gguf(tmp_path / "d.gguf", deep)
    assert G.read_config(G.open_gguf(tmp_path / "d.gguf")) == deep.config


def test_bfloat16_casts_each_dequantized_tensor(tmp_path):
    model = random_model(tiny_config(vocab_size=256))
    write_gguf(tmp_path / "m.gguf", model)
    loaded = load_model(tmp_path / "m.gguf", dtype="bfloat16")
    assert loaded.config.dtype == "bfloat16"
    assert_same_params(pure(loaded), cast(pure(model), jnp.bfloat16))


def test_quantized_llama_through_llm_matches_its_dequantized_safetensors_copy(tmp_path):
    """Matrices in every quant type, norms in F16 and BF16: `LLM("m.gguf")` gives the logits and greedy tokens
    of a safetensors checkpoint holding what the blocks decode to (by gguf-py, checked against the
    reference decoder above). Hidden 256, so that K-quant blocks (256 values) fit its rows; gguf-py
    cannot make K-quants, so those tensors are random blocks of small scale."""
    config = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=256)
    model = random_model(config)
    rng = np.random.default_rng(2)
    types = {"token_embd.weight": Q.Q5_1, "output_norm.weight": Q.BF16,  # ffn_norm stays F32
             "blk.0.attn_v.weight": Q.Q8_0, "blk.0.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1,
             "blk.0.ffn_up.weight": Q.Q5_0, "blk.0.attn_norm.weight": Q.F16, "blk.1.attn_norm.weight": Q.F16}
    small = (1e-4, 1e-3)
    raw = {"output.weight": (random_blocks("Q6_K", rng, 256, 1, small), Q.Q6_K),
           "blk.1.attn_v.weight": (random_blocks("Q2_K", rng, 32, 1, small), Q.Q2_K),
           "blk.1.ffn_gate.weight": (random_blocks("IQ4_XS", rng, 256, 1, (1e-5, 1e-4)), Q.IQ4_XS),
           "blk.1.ffn_up.weight": (random_blocks("IQ4_NL", rng, 256, 8, small), Q.IQ4_NL)}
    for i, (q, down) in enumerate([("Q4_K", "Q4_K"), ("Q3_K", "Q5_K")]):
        raw.update({f"blk.{i}.attn_q.weight": (random_blocks(q, rng, 64, 1, small), Q[q]),
                    f"blk.{i}.attn_k.weight": (random_blocks("Q6_K", rng, 32, 1, small), Q.Q6_K),
                    f"blk.{i}.ffn_down.weight": (random_blocks(down, rng, 256, 1, small), Q[down])})
    meant = write_gguf(tmp_path / "m.gguf", model, types=types, raw=raw)
    assert {t.tensor_type.name for t in G.open_gguf(tmp_path / "m.gguf").tensors} == set(KINDS)
    reference = save_hf_dir(tmp_path / "ref", config, meant)
    from_gguf, from_dir = load_model(tmp_path / "m.gguf"), load_model(reference)
    assert_same_params(pure(from_gguf), pure(from_dir))
    tokens = jnp.asarray(PROMPTS[1])[None]
    np.testing.assert_array_equal(dense_logits(from_gguf, tokens), dense_logits(from_dir, tokens))
    kw = dict(block_size=8, num_blocks=32, max_num_seqs=2, max_model_len=64, log_stats=False)
    greedy = [o.outputs[0].token_ids for o in LLM(str(tmp_path / "m.gguf"), **kw).generate(PROMPTS, GREEDY)]
    assert greedy == [o.outputs[0].token_ids for o in LLM(str(reference), **kw).generate(PROMPTS, GREEDY)]
    # The quantization is real: f32 weights would answer differently somewhere.
    assert not np.array_equal(np.asarray(dense_logits(from_gguf, tokens)), np.asarray(dense_logits(model, tokens)))


def test_an_unsupported_type_in_a_model_file_fails_before_any_weight_is_read(tmp_path):
    model = random_model(tiny_config(vocab_size=256, hidden_size=256, intermediate_size=256))
    rng = np.random.default_rng(1)
    raw = {"blk.1.ffn_up.weight": (random_blocks("IQ2_XXS", rng, 256, 1), Q.IQ2_XXS)}
    write_gguf(tmp_path / "m.gguf", model, raw=raw)
    with pytest.raises(ValueError, match=r"tensor 'blk\.1\.ffn_up\.weight' has type IQ2_XXS, which is not supported"):
        LLM(str(tmp_path / "m.gguf"), num_blocks=16, log_stats=False)


def test_a_cut_or_foreign_file_is_refused_naming_it(tmp_path):
    model = random_model(tiny_config(vocab_size=256))
    write_gguf(tmp_path / "m.gguf", model)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "header.gguf").write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(CheckpointError, match=r"header\.gguf: not a readable GGUF file \("):
        load_model(tmp_path / "header.gguf")
    (tmp_path / "data.gguf").write_bytes(data[:-100])  # cut inside the last tensor
    with pytest.raises(CheckpointError, match=r"data\.gguf: tensor '.*' runs past the end of the file"):
        load_model(tmp_path / "data.gguf")
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(CheckpointError, match=r"v1\.gguf: GGUF version 1 is not supported \(2 and 3 are\)$"):
        load_model(tmp_path / "v1.gguf")
    (tmp_path / "be.gguf").write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(CheckpointError, match=r"version 50331648 is not supported .*; a big-endian file"):
        load_model(tmp_path / "be.gguf")


def test_unsupported_files_are_refused_by_name(tmp_path):
    model = random_model(tiny_config(vocab_size=256))
    write_gguf(tmp_path / "m.gguf", model)
    data = (tmp_path / "m.gguf").read_bytes()
    # The same bytes under another architecture (every "llama" of the keys renamed with it).
    (tmp_path / "g.gguf").write_bytes(data.replace(b"llama", b"gemma"))
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma' is not supported; "
                                         r"supported: \['gemma2', 'gemma3', 'llama', 'qwen2', 'qwen3'\]"):
        LLM(str(tmp_path / "g.gguf"), num_blocks=16, log_stats=False)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match=r"x\.gguf: not a GGUF file"):
        load_model(tmp_path / "x.gguf")
    scaled = random_model(tiny_config(vocab_size=256, rope_scaling=LLAMA3_SCALING))  # original 64, not Meta's 8192
    write_gguf(tmp_path / "r.gguf", scaled)
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight holds factors that Llama 3's RoPE scaling "):
        load_model(tmp_path / "r.gguf")
    assert G.load_gguf(tmp_path / "m.gguf")[1] is None  # no tokenizer.ggml.*: token-id prompts only
    linear = {"llama.rope.scaling.type": ("linear", G.gguf.GGUFValueType.STRING)}
    write_gguf(tmp_path / "s.gguf", model, metadata=linear)
    with pytest.raises(CheckpointError, match=r"scaled RoPE \(llama\.rope\.scaling\.type='linear'\) is not"):
        load_model(tmp_path / "s.gguf")
