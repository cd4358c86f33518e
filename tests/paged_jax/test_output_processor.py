"""Incremental detokenization and stop strings against full decodes of the output, on the embedded
model's byte-level BPE tokenizer, whose byte tokens split multi-byte characters."""
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from models.tokenizer import Tokenizer, load_tokenizer
from paged_jax import SamplingParams
from paged_jax.core.model_output import ModelOutput
from paged_jax.core.sequence import Request, Sequence, Status
from paged_jax.engine.output_processor import OutputProcessor

TOKENIZER = load_tokenizer(Path(__file__).resolve().parents[2] / "models" / "embedded")
SPECIAL = 0  # <|endoftext|>
PIECES = ("é", "日本語", "😀", " naïve café", "Ω≈ç√", "def f(x):\n    return x", " plain words", "🇫🇷",
          "ß", "\t中文", " 1 + 2")
PROMPT = [5, 6, 7]
FFFD = "\ufffd"


def decode(ids, skip=True):
    return TOKENIZER.decode(ids, skip_special_tokens=skip)


def random_output(rng, num_pieces, noise=0.0):
    """Tokens of random text; with `noise`, that fraction of them replaced by any vocabulary token,
    which leaves characters broken for good, and as many special tokens inserted anywhere (inside a
    character's bytes too)."""
    ids = TOKENIZER.encode("".join(rng.choice(PIECES, num_pieces)), add_special_tokens=False)
    noisy = np.flatnonzero(rng.random(len(ids)) < noise)
    for i in noisy:
        ids[i] = int(rng.integers(0, TOKENIZER.vocab_size))
    for i in sorted(rng.integers(0, len(ids), len(noisy)), reverse=True):
        ids.insert(i, SPECIAL)
    return ids


def make_seq(params, prompt=PROMPT):
    request = Request("r", None, list(prompt), params, 0.0)
    seq = Sequence(request, 0, list(prompt), np.zeros(2, np.uint32), status=Status.RUNNING, slot=0)
    request.seqs.append(seq)
    return request, seq


def device_out(tokens):
    """One call's output for one row: logprob -0.1 * (j + 1), the token itself as the top one."""
    k = len(tokens)
    lps = -0.1 * np.arange(1, k + 1)[None]
    return ModelOutput(tokens=np.array([tokens]), logprob=lps, rank=np.ones((1, k), int),
                       top_ids=np.array(tokens)[None, :, None], top_logprobs=lps[..., None],
                       finish=np.zeros(1, np.int32), steps=np.int32(k))


def run(proc, output, params, chunks, prompt=PROMPT):
    """Feed `output` in calls of the given sizes as the engine does (the scheduler appends the
    tokens, then the output processor sees them); the sequence ends on length after the last call
    -> (request, seq, [(tokens so far, text) after each call])."""
    request, seq = make_seq(params, prompt)
    texts, done = [], 0
    for size in chunks:
        step = output[done: done + size]
        done += size
        out = device_out(step)
        seq.token_ids += step
        seq.token_logprobs += out.logprob[0].tolist()
        if done >= len(output):
            seq.status = Status.FINISHED_LENGTH
        if proc.process(seq, out, 0, len(step)):
            seq.status = Status.FINISHED_STOPPED
        texts.append((seq.num_output, proc.make_output(request).outputs[0].text))
        if seq.finished:
            break
    return request, seq, texts


def random_chunks(rng, n):
    return rng.integers(1, 9, n).tolist()  # 1 to 8 tokens a step, as K-step decode calls give


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_is_the_full_decode_without_broken_characters(skip, seed):
    rng = np.random.default_rng(seed)
    output = random_output(rng, 300, noise=0.05)
    output[-1] = TOKENIZER.encode("日", add_special_tokens=False)[0]  # ends inside a character
    params = SamplingParams(max_tokens=len(output), skip_special_tokens=skip)
    _, _, texts = run(OutputProcessor(TOKENIZER), output, params, random_chunks(rng, len(output)))
    final = texts[-1][1]
    assert final == decode(output, skip) and final.endswith(FFFD)
    pending = 0
    for n, text in texts[:-1]:
        full = decode(output[:n], skip)
        assert final.startswith(text) and not text.endswith(FFFD)
        if full.endswith(FFFD):  # the last character may be incomplete: it waits, the rest is out
            pending += 1
            assert full.startswith(text) and len(full) - len(text) <= 4
        else:
            assert text == full
    assert pending >= 5  # the split characters were seen, not only whole ones
    assert FFFD in final[:-1] and "<|endoftext|>" in decode(output, False)  # broken for good, specials


@pytest.mark.parametrize("decoder, words", [
    (tokenizers.decoders.WordPiece(prefix="##"), ["hello", "##s", "world", ".", "##x"]),
    (tokenizers.decoders.Metaspace(), ["\u2581hello", "s", "\u2581world", "\u2581.", "x"]),
])
def test_decoders_that_join_tokens_decode_in_context(decoder, words):
    """WordPiece puts a space between words and Metaspace turns "\u2581" into one, each except at
    the start of a decode: a new token decoded alone would lose it, the window's context keeps it."""
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    inner.decoder = decoder
    tok = Tokenizer(inner, eos_token_ids=())
    rng = np.random.default_rng(3)
    output = rng.integers(0, len(words), 200).tolist()
    _, _, texts = run(OutputProcessor(tok), output, SamplingParams(max_tokens=200), random_chunks(rng, 200))
    assert [text for _, text in texts] == [tok.decode(output[:n]) for n, _ in texts]
    assert " world" in texts[-1][1]


def test_the_first_token_is_decoded_after_the_prompt():
    """A sentencepiece decode drops the space of its first token: decoded after the prompt's last
    tokens, the first output token keeps it (vLLM's offsets start in the prompt). A prompt that ends
    inside a character gives no context: its broken text would not be a prefix of the window's."""
    words = ["\u2581hello", "s", "\u2581world", "x"]
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="x"))
    inner.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(inner, eos_token_ids=())
    prompt = [0, 1, 3, 3, 1, 1]  # more than the 5 tokens of context
    _, _, texts = run(OutputProcessor(tok), [2, 3, 0], SamplingParams(max_tokens=3), [1, 2], prompt)
    assert [text for _, text in texts] == [" world", " worldx hello"]
    assert tok.decode(prompt + [2, 3, 0]) == "hellosxxss worldx hello"
    nihon = TOKENIZER.encode("日本", add_special_tokens=False)  # 6 byte tokens
    output = nihon[1:] + TOKENIZER.encode(" plain words", add_special_tokens=False)
    _, _, texts = run(OutputProcessor(TOKENIZER), output, SamplingParams(max_tokens=len(output)),
                      [1] * len(output), PROMPT + nihon[:1])
    assert texts[-1][1] == decode(output) == FFFD * 2 + "本 plain words"


class CountingTokenizer:
    """The embedded tokenizer, recording the length of every decode's input and output."""

    def __init__(self):
        self.calls = []

    def decode(self, ids, *, skip_special_tokens=True):
        text = decode(ids, skip_special_tokens)
        self.calls.append((len(ids), len(text)))
        return text


def test_each_token_is_decoded_in_a_bounded_window():
    """A step decodes only the new tokens' window: a character is at most 4 byte tokens, so a window
    is the last emission (<= 4 tokens) plus the tokens up to the next whole character (<= 4). A
    re-decode of the whole output per step (the O(L^2) this replaced) decodes ~L tokens a call."""
    rng = np.random.default_rng(2)
    output = random_output(rng, 800)
    counting = CountingTokenizer()
    params = SamplingParams(max_tokens=len(output), stop=["never in the output"])
    _, _, texts = run(OutputProcessor(counting), output, params, random_chunks(rng, len(output)))
    assert texts[-1][1] == decode(output) and len(output) > 3000
    window_tokens, window_chars = np.array(counting.calls).T
    assert len(counting.calls) <= 2 * len(output)
    assert window_tokens.max() <= 8 and window_tokens.sum() <= 5 * len(output)
    assert window_chars.sum() <= 5 * len(texts[-1][1])


def test_no_tokenizer_means_no_text():
    _, seq, texts = run(OutputProcessor(None), [5, 9, 11], SamplingParams(), [2, 1])
    assert texts == [(2, ""), (3, "")] and seq.output_ids == [5, 9, 11]


def reference_stop(output, stops, include, min_tokens=0):
    """From full decodes: text is final after a token whose decode ends on a whole character; the
    first token after min_tokens whose final text holds a stop string the earlier final text did not
    -> (tokens kept, text, stop)."""
    seen = ""
    for k in range(1, len(output) + 1):
        text = decode(output[:k])
        if text.endswith(FFFD):
            continue
        for stop in stops if k > min_tokens else ():
            at = text.find(stop, max(0, len(seen) - len(stop) + 1))
            if at >= 0:
                return k, text[: at + (len(stop) if include else 0)], stop
        seen = text
    return len(output), decode(output), None


TEXT = "x = 'é日本語' + naïve # 😀😀 done; café 日本語 end\n" * 3


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("stops, min_tokens", [
    (["本語' +"], 0),           # inside multi-byte characters, across several tokens
    (["done;", "😀😀"], 0),      # the earlier completed wins, whatever the list order
    (["😀 done", "done"], 0),    # the same token completes both: the first listed wins
    (["本語' +"], 20),          # its first occurrence completes within min_tokens: the second counts
])
def test_stop_strings_across_token_boundaries(include, chunk, stops, min_tokens):
    output = TOKENIZER.encode(TEXT, add_special_tokens=False)
    kept, text, stop = reference_stop(output, stops, include, min_tokens)
    assert stop is not None and kept < len(output) and stop not in decode([output[kept - 1]])
    params = SamplingParams(max_tokens=len(output), stop=stops, include_stop_str_in_output=include,
                            min_tokens=min_tokens, logprobs=0)
    request, out, texts = run(OutputProcessor(TOKENIZER), output, params, [chunk] * len(output))
    completion = OutputProcessor(TOKENIZER).make_output(request).outputs[0]
    assert (completion.token_ids, completion.text, completion.stop_reason) == (output[:kept], text, stop)
    assert completion.finish_reason == "stop" and out.num_output == kept
    assert len(out.token_logprobs) == len(completion.logprobs) == kept
    # Feeding ended with the step that held the stop's token; with 5 a step, three of the four cases
    # hit it mid-step, so the tokens after it in that step were dropped.
    assert texts[-1] == (kept, text) and len(texts) == -(-kept // chunk)
    if min_tokens:
        first = reference_stop(output, stops, include)[0]
        assert first <= min_tokens < kept


def test_stop_string_text_is_searched_only_once_complete():
    """The stop "a日" is in the text only once the character's last byte token arrives: the token
    that completes it is the last kept, " z" after it is dropped."""
    output = [88, 65, 163, 246, 99, 1062]  # "x", "a", the 3 bytes of "日", " z"
    assert decode(output) == "xa日 z"
    _, seq, texts = run(OutputProcessor(TOKENIZER), output, SamplingParams(stop=["a日"]), [1] * 6)
    assert texts == [(1, "x"), (2, "xa"), (3, "xa"), (4, "xa"), (5, "x")]
    assert seq.output_ids == output[:5] and seq.stop_reason == "a日" and seq.status is Status.FINISHED_STOPPED
