"""`LLM.generate`'s prompt forms: one prompt of any form is a batch of one."""
import pytest
import tokenizers

from models.tokenizer import Tokenizer
from paged_jax import LLM, SamplingParams
from tests.models.model_testing import random_model, tiny_config

IDS = [5, 17, 99, 3, 42, 8]
TEXT = " ".join(f"w{i}" for i in IDS)


@pytest.fixture(scope="module")
def llm():
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    inner.decoder = tokenizers.decoders.WordPiece(prefix="##")
    model = random_model(tiny_config(max_position_embeddings=256, eos_token_id=None))
    return LLM(model, tokenizer=Tokenizer(inner, eos_token_ids=()), block_size=8, num_blocks=32,
               max_num_seqs=2, log_stats=False)


def completion(outs):
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def test_a_single_dict_prompt_is_one_request(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert llm.get_tokenizer().encode(TEXT) == IDS
    expected = completion(llm.generate([IDS], params))
    assert len(expected) == 1 and len(expected[0][1]) == 5
    assert completion(llm.generate({"prompt": TEXT}, params)) == expected
    assert completion(llm.generate({"prompt_token_ids": IDS}, params)) == expected
    assert completion(llm.generate({"prompt": TEXT, "cache_salt": "a"}, params)) == expected
    assert completion(llm.generate([{"prompt": TEXT}, {"prompt_token_ids": IDS}], params)) == expected * 2
    assert completion(llm.generate(TEXT, params)) == completion(llm.generate(IDS, params)) == expected
