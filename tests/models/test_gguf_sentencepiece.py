"""A GGUF with a SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral,
TinyLlama): stories260K (tests/data/stories260K) written as llama.cpp's converter writes it, the
weights with their q/k rows permuted and the pieces, scores and types of llama2.c's tok512.bin (the
model's own SentencePiece vocabulary, exported by llama2.c). References: transformers reading the
same file (where it is installed), the checkpoint's tokenizer.json (which encodes as llama2.c's
run.c does), and the story llama2.c publishes for the model."""
import json
from pathlib import Path

import gguf
import pytest
import tokenizers

from gguf_testing import llama2c_vocab, write_gguf
from models.checkpoint import CheckpointError, load_model
from models.gguf_file import open_gguf
from models.gguf_tokenizer import gguf_tokenizer, sentencepiece_merges
from paged_jax import LLM, SamplingParams
from paged_jax.sampling_params import StructuredOutputsParams

STORIES = Path(__file__).resolve().parents[1] / "data" / "stories260K"
V = gguf.GGUFValueType
TEXTS = ["Once upon a time, there was a little girl named Lily.", "Hello", "  two leading spaces",
         "tabs\tand\nnewlines\n\n\n", "trailing spaces   ", "émigré naïve, 日本語 😀🎉", "x²³ ½ 3.14159",
         "Tom said, \"Let's go!\"</s><s> Lily was sad.", "<unk>", "", " ", "\n"]
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def stories_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "stories260K.gguf"
    write_gguf(path, load_model(STORIES), metadata=llama2c_vocab(STORIES / "tok512.bin"))
    return path


@pytest.fixture(scope="module")
def ours(stories_gguf):
    return gguf_tokenizer(open_gguf(stories_gguf))


def test_merges_rank_each_cut_of_a_token_by_its_score():
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "cab"]
    scores = [0.0, -10.0, -11.0, -12.0, -1.0, -2.0, -3.0, -1.0]
    # "ab" and "cab" tie on score: "c" + "ab" has the longer right piece, so it ranks first; "abc"'s
    # two cuts tie on everything but the left piece's length.
    assert sentencepiece_merges(tokens, scores) == [("c", "ab"), ("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_tokenizer_matches_the_checkpoints_own(ours):
    """tokenizer.json of the directory the file was written from, on texts that neither start with a
    space nor hold a special token: there transformers' GGUF build prepends no "▁" (it does not
    before a text's own space, nor after a special token) where the directory's legacy one does."""
    own = tokenizers.Tokenizer.from_file(str(STORIES / "tokenizer.json"))
    for text in [t for t in TEXTS[:7] if not t.startswith(" ")]:
        assert ours.encode(text) == own.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == text, text
    assert ours.encode(TEXTS[0]) == [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426]
    # Characters outside the 512 pieces are spelled by their UTF-8 bytes (<0xE6> is id 3 + 0xE6).
    assert ours.encode("日", add_special_tokens=False) == [410, 3 + 0xE6, 3 + 0x97, 3 + 0xA5]  # "▁", bytes
    assert (ours.eos_token_ids, ours.bos_token_id, ours.bos_token, ours.eos_token) == ((2,), 1, "<s>", "</s>")


def test_tokenizer_matches_transformers_reading_the_same_file(ours, stories_gguf):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(stories_gguf.parent), gguf_file=stories_gguf.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    # No "▁" after a special token, as in transformers (llama.cpp would write one).
    assert ours.encode("</s>Lily", add_special_tokens=False) == [2, 438, 310]  # "L", "ily"; "▁Lily" is 386
    assert ours.encode("  two", add_special_tokens=False) == [410, 259, 424, 414]  # "▁", "▁t", "w", "o"


def test_the_gguf_tells_the_published_story(stories_gguf):
    llm = LLM(str(stories_gguf), log_stats=False)
    from_bos, continued = llm.generate([[1], STORY[:53]], [SamplingParams(temperature=0.0, max_tokens=n)
                                                           for n in (64, 40)])
    assert from_bos.outputs[0].text.startswith(STORY)
    assert continued.prompt_token_ids == [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426]
    assert continued.outputs[0].token_ids == from_bos.outputs[0].token_ids[15:15 + 40]
    # The first new token is "▁She": its space is the text's (vLLM decodes new tokens after the prompt's).
    assert continued.outputs[0].text.startswith(" She loved to play outside in the park.")


def test_a_gguf_without_a_vocabulary_takes_its_base_models_tokenizer(tmp_path):
    """vLLM's `tokenizer=` (as it advises for a GGUF): a file written without tokenizer metadata,
    given the checkpoint's directory, encodes and tells the story as the SentencePiece file does."""
    write_gguf(tmp_path / "bare.gguf", load_model(STORIES))
    assert LLM(str(tmp_path / "bare.gguf"), log_stats=False).get_tokenizer() is None
    llm = LLM(str(tmp_path / "bare.gguf"), tokenizer=STORIES, log_stats=False)
    out = llm.generate([STORY[:53]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426]
    assert out.outputs[0].text.startswith(" She loved to play")
    with pytest.raises(ValueError, match=r"tokenizer='.*bare\.gguf' has no tokenizer: give a directory with "):
        LLM(str(tmp_path / "bare.gguf"), tokenizer=tmp_path / "bare.gguf", log_stats=False)


def test_a_json_schema_holds_with_byte_fallback_pieces(stories_gguf):
    """Structured output over a SentencePiece vocabulary: llguidance reads its "▁" and <0xXX> pieces
    as the bytes they stand for, so the grammar's braces, quotes and digits (byte tokens here) and
    its spaces ("▁") are allowed exactly where they belong."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    for out in LLM(str(stories_gguf), log_stats=False).generate(["Once upon a time, Lily", "Tom said"], params):
        answer = json.loads(out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop" and sorted(answer) == ["age", "name"]
        assert 1 <= answer["age"] <= 99 and len(answer["name"]) <= 12


def test_bad_sentencepiece_metadata_is_refused_by_name(tmp_path):
    model = load_model(STORIES)
    vocab = llama2c_vocab(STORIES / "tok512.bin")
    write_gguf(tmp_path / "a.gguf", model, metadata={k: v for k, v in vocab.items() if k != "tokenizer.ggml.scores"})
    with pytest.raises(CheckpointError, match=r"a\.gguf: required metadata 'tokenizer\.ggml\.scores' is missing"):
        gguf_tokenizer(open_gguf(tmp_path / "a.gguf"))
    write_gguf(tmp_path / "b.gguf", model, metadata={**vocab, "tokenizer.ggml.scores": ([0.0] * 7, V.ARRAY, V.FLOAT32)})
    with pytest.raises(ValueError, match=r"b\.gguf: tokenizer\.ggml\.scores has 7 entries for 512 tokens"):
        gguf_tokenizer(open_gguf(tmp_path / "b.gguf"))
    write_gguf(tmp_path / "c.gguf", model, metadata={**vocab, "tokenizer.ggml.model": ("t5", V.STRING)})
    with pytest.raises(ValueError, match=r"c\.gguf: tokenizer\.ggml\.model 't5' is not supported "
                                         r"\(supported: \['gpt2', 'llama'\]\)"):
        LLM(str(tmp_path / "c.gguf"), log_stats=False)
    write_vocab(tmp_path / "d.gguf", "phi3", vocab)  # Phi-3's prefix space needs its own build
    with pytest.raises(ValueError, match=r"d\.gguf: the SentencePiece vocabulary of a 'phi3' file is not supported"):
        gguf_tokenizer(open_gguf(tmp_path / "d.gguf"))


def write_vocab(path, arch, metadata):
    """A GGUF of `arch` holding only tokenizer metadata."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, spec in metadata.items():
        writer.add_key_value(key, *spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_gemma_vocabulary_matches_transformers(tmp_path):
    """Gemma 2's files: merges in the vocabulary's order (their scores, all 0 here, say nothing),
    pieces of spaces stored as spaces ("  " and "   " added at the end), no "▁" prepended, BOS
    added; "<end_of_turn>", which the files do not name, ends a generation as in llama.cpp."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    vocab = llama2c_vocab(STORIES / "tok512.bin")
    tokens = vocab["tokenizer.ggml.tokens"][0] + ["  ", "   ", "<end_of_turn>"]
    vocab.update({"tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
                  "tokenizer.ggml.scores": ([0.0] * len(tokens), V.ARRAY, V.FLOAT32),
                  "tokenizer.ggml.token_type": (vocab["tokenizer.ggml.token_type"][0] + [1, 1, 3], V.ARRAY, V.INT32),
                  "tokenizer.ggml.bos_token_id": (1, V.UINT32), "tokenizer.ggml.eos_token_id": (2, V.UINT32),
                  "tokenizer.ggml.add_bos_token": (True, V.BOOL)})
    write_vocab(tmp_path / "g.gguf", "gemma2", vocab)
    ours = gguf_tokenizer(open_gguf(tmp_path / "g.gguf"))
    # transformers' builder, as from_pretrained runs it; BOS is added by the class, checked below.
    theirs = convert_gguf_tokenizer(*get_gguf_tokenizer(str(tmp_path / "g.gguf"))[:2])[0]
    assert ours.eos_token_ids == (2, 514)
    for text in TEXTS + ["a  b   c    d", "Lily    went", "<end_of_turn>Lily"]:
        assert ours.encode(text) == [1] + ours.encode(text, add_special_tokens=False), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    # "▁b" comes before "▁▁" in the vocabulary, so it merges first; "▁▁" alone is one piece.
    assert ours.encode("a  b  ", add_special_tokens=False) == [412, 410, 268, 512]
    assert ours.encode("Lily")[:2] == [1, 438]  # BOS, then "L": no "▁" before the text
    assert ours.decode(ours.encode(" Lily went")) == " Lily went"
