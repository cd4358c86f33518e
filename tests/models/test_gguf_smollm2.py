"""A real GGUF: SmolLM2-135M-Instruct, Q4_1 (fetched once by the `smollm2_gguf` fixture). Its config
and tokenizer come from the metadata; transformers reading the same file is the reference where it
is installed: the tokenizer encodes and decodes alike, the chat template renders alike, and greedy
answers are the same token for token. Without transformers (the Python 3.13 line) the exact ids
found with it are still checked, and a chat question gets its answer."""
import gguf
import pytest

from models.gguf import load_gguf, open_gguf
from models.gguf_tokenizer import gguf_tokenizer
from models.llama import LlamaConfig
from paged_jax import LLM, SamplingParams

TEXTS = ["The capital of France is", "Hello world", "  two leading spaces", "tabs\tand\nnewlines\n\n\n",
         "trailing spaces   ", "émigré naïve façade, 日本語のテキスト", "emoji 😀🎉 and a family 👩‍👩‍👧",
         "12345 3.14159 1,000,000 x²³ ½", "I'm sure they'd've said it's fine",
         "    def f(x):\n        return x  # ok\r\n", "hello!!!\n\nworld", "<|im_start|>user\nhi<|im_end|>\n",
         "<|endoftext|><repo_name>", ""]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "The largest planet in the solar system is"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 32
pytestmark = pytest.mark.usefixtures("optimized_module")  # a real model: its steps' run time outweighs their compile


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """(model, tokenizer) loaded once for the module."""
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def answers(smollm2):
    """The engine's greedy outputs for PROMPTS (NEW_TOKENS each, ignore_eos) and, last, for QUESTION
    through the chat template (up to NEW_TOKENS, stopping at EOS): one batch, one set of compiles."""
    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=8, max_model_len=256, log_stats=False)
    chat = tokenizer.apply_chat_template(QUESTION, tokenize=True)
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)] * len(PROMPTS)
    return [o.outputs[0] for o in llm.generate(PROMPTS + [chat], params + [SamplingParams(temperature=0.0,
                                                                                         max_tokens=NEW_TOKENS)])]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_config_and_special_tokens_from_the_metadata(smollm2):
    model, tokenizer = smollm2
    assert model.config == LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, dtype="float32")
    # EOS, then "<|endoftext|>", which llama.cpp also ends a generation at (by its text).
    assert (tokenizer.eos_token_ids, tokenizer.bos_token_id) == ((2, 0), 1)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.vocab_size) == ("<|im_start|>", "<|im_end|>", 49152)
    # As transformers encodes it (asserted below where it is installed); no BOS: add_bos_token is false.
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_the_file_parses_as_gguf_py_parses_it(smollm2_gguf):
    """models.gguf_file against gguf-py's GGUFReader on the real file: every metadata value, every
    tensor's name, type, shape and bytes."""
    import numpy as np

    ours, theirs = open_gguf(smollm2_gguf), gguf.GGUFReader(smollm2_gguf)
    assert ours.metadata == {key: f.contents() for key, f in theirs.fields.items() if not key.startswith("GGUF.")}
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152 and len(ours.metadata["tokenizer.ggml.merges"]) == 48900
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [
        (t.name, t.tensor_type, tuple(reversed(t.shape.tolist()))) for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        np.testing.assert_array_equal(mine.data, reference.data)


def test_every_text_decodes_back_to_itself(smollm2):
    tokenizer = smollm2[1]
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")) == "user\nhi\n"


def test_tokenizer_and_chat_template_match_transformers(smollm2, hf_tokenizer):
    tokenizer = smollm2[1]
    prompt = tokenizer.apply_chat_template(QUESTION)
    assert prompt == hf_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    for text in TEXTS + [prompt]:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        plain = tokenizer.encode(text, add_special_tokens=False)
        assert plain == hf_tokenizer(text, add_special_tokens=False).input_ids, text
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_bos_special_tokens_and_the_llama3_split_match_transformers(tmp_path, smollm2_gguf):
    """The same vocabulary relabelled: add_bos_token true, tokenizer.ggml.pre "llama-bpe" (Llama 3's
    split regex: among other things, punctuation takes the line breaks after it), and token types
    all NORMAL but one CONTROL and one USER_DEFINED (the named bos/eos/unk tokens stay special)."""
    transformers = pytest.importorskip("transformers")
    source = gguf.GGUFReader(smollm2_gguf)
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.chat_template"):
        f = source.get_field(key)
        writer.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    types = [gguf.TokenType.NORMAL] * 49152
    types[5], types[7] = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED  # <file_sep>, <gh_stars>
    writer.add_token_types(types)
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = gguf_tokenizer(open_gguf(tmp_path / "tok.gguf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in TEXTS + ["<|endoftext|><repo_name><file_sep><gh_stars>"]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("<|endoftext|><repo_name><file_sep><gh_stars>") == [1, 0, 44, 22139, 79, 1245, 46, 5, 7]
    # "!!!" then "\n\n" as one piece under Llama 3's split, two "\n" under GPT-2's (SmolLM's own).
    assert ours.encode("hello!!!\n\nworld") == [1, 28120, 29646, 1116, 6693]
    assert gguf_tokenizer(open_gguf(smollm2_gguf)).encode("hello!!!\n\nworld") == [28120, 29646, 198, 198, 6693]


def test_the_capital_of_france_is_paris(answers):
    assert answers[0].text.startswith(" Paris.")
    assert answers[0].token_ids[:2] == [7042, 30]  # " Paris", "."


def test_greedy_answers_match_transformers_reading_the_same_file(answers, smollm2, smollm2_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    hf.generation_config.eos_token_id = None  # as ignore_eos
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's spinning threads run 4x slower on a CPU shared with other jobs
    try:
        for prompt, out in zip(PROMPTS, answers):
            ids = torch.tensor([smollm2[1].encode(prompt)])
            with torch.no_grad():
                expected = hf.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                              do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
            assert out.token_ids == expected, prompt
    finally:
        torch.set_num_threads(threads)


def test_a_chat_question_gets_paris(answers, smollm2):
    tokenizer, answer = smollm2[1], answers[-1].token_ids
    paris = [tokenizer.encode(word, add_special_tokens=False) for word in (" Paris", "Paris")]
    assert [7042] in paris  # one token, as the answer to PROMPTS[0] shows it
    assert any(answer[i:i + len(p)] == p for p in paris for i in range(len(answer))), tokenizer.decode(answer)
    assert answers[-1].finish_reason == "stop" and answer[-1] == 2  # it ends its turn with <|im_end|>
