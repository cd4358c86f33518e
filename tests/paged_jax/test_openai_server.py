"""The OpenAI-compatible server end to end: real servers (`python -m paged_jax.serve`) on free ports
of 127.0.0.1 with the embedded model, driven by the real `openai` client.

Server A has an API key, a chat template and a pool small enough to preempt; server B has neither
key nor template. Outputs are checked against `LLM.generate` on the same model."""
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from paged_jax import LLM, SamplingParams  # noqa: E402
from tests.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "embedded"
KEY = "test-key"
# ChatML, with Qwen's (hermes) way of writing tools, calls and their results when a request has them.
CHATML = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
          "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' and m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
          "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
          "{% endfor %}{% elif m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
          "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ENGINE = dict(num_blocks=40, max_num_seqs=32)  # 39 blocks of 16 tokens: 64 streams must preempt
PROMPT = "def fibonacci(n):\n"


class Server:
    def __init__(self, tmp, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"server-{self.port}.log", "w+")
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PAGED_JAX_API_KEY": ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "paged_jax.serve", "--port", str(self.port),
                                      "--uvicorn-log-level", "warning", "--no-compilation-cache",
                                      "--warmup-prompt-len", "0", *args],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(self.output())

    def wait_while_warming(self, timeout=300) -> tuple[dict, list]:
        """Wait until /health is 200 while the warm-up runs in the background, one completion sent
        at the first answer of /health -> (that first answer's status and JSON body, the completion's
        (status, body))."""
        deadline, first = time.monotonic() + timeout, None
        while first is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    first = {"status": r.status}
            except urllib.error.HTTPError as e:
                first = {"status": e.code, "body": json.loads(e.read())}
            except OSError:
                time.sleep(0.1)
        answer = self.post("/v1/completions", json.dumps({"prompt": "def f", "max_tokens": 3}).encode())
        self.wait(timeout)
        return first, answer

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def post(self, path, data: bytes, headers=None):
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self) -> dict:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return {(s.name, s.labels.get("finished_reason")): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self):
        self.proc.terminate()
        try:
            assert self.proc.wait(30) == 0, self.output()  # SIGTERM is a clean shutdown
        finally:
            self.proc.kill()
            self.proc.wait()
            self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chat.jinja").write_text(CHATML)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    a = Server(tmp, "--api-key", KEY, "--chat-template", str(tmp / "chat.jinja"), "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", *flags)
    b = Server(tmp, "--served-model-name", "tiny", "--max-num-seqs", "4", "--warmup-prompt-len", "8")
    try:
        b.warming = b.wait_while_warming()
        yield a.wait(), b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers[0].url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    return LLM(str(MODEL), log_stats=False, **ENGINE)


def test_greedy_completion_is_llm_generate_and_usage_is_exact(client, reference):
    want = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24))[0]
    got = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=24,
                                    temperature=0.0, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    choice = got.choices[0]
    assert choice.text == want.outputs[0].text
    assert [int(t.split(":")[1]) for t in choice.logprobs.tokens] == want.outputs[0].token_ids
    assert choice.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        len(want.prompt_token_ids), 24, len(want.prompt_token_ids) + 24)


def test_sampling_fields_reach_the_engine(client, reference):
    """top_k, min_p, the penalties, seed, stop, min_tokens and include_stop_str_in_output, as
    vLLM's extras: the server's text is LLM.generate's with the same SamplingParams."""
    fields = dict(temperature=0.8, seed=11, top_k=8, min_p=0.05, repetition_penalty=1.3,
                  frequency_penalty=0.5, presence_penalty=0.2, min_tokens=2, max_tokens=40)
    free = reference.generate([PROMPT], SamplingParams(**fields))[0].outputs[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    want = reference.generate([PROMPT], SamplingParams(**fields, stop=[stop], include_stop_str_in_output=True))
    got = client.completions.create(model="embedded", prompt=PROMPT, stop=[stop], **{
        k: v for k, v in fields.items() if k in ("temperature", "seed", "frequency_penalty", "presence_penalty",
                                                 "max_tokens")},
        extra_body={k: fields[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens")}
        | {"include_stop_str_in_output": True})
    assert got.choices[0].text == want[0].outputs[0].text and got.choices[0].text.endswith(stop)
    assert (got.choices[0].finish_reason, got.choices[0].stop_reason) == ("stop", stop)


def test_streamed_chunks_join_to_the_unstreamed_text(client):
    kwargs = dict(model="embedded", prompt=PROMPT, max_tokens=32, temperature=0.9, seed=7)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]  # exactly once, on the last chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_2_gives_two_indexed_choices_and_echo_leads_with_the_prompt(client):
    got = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=16, n=2, temperature=1.0,
                                    seed=3, echo=True)
    assert [c.index for c in got.choices] == [0, 1]
    assert all(c.text.startswith(PROMPT) for c in got.choices)
    assert got.choices[0].text != got.choices[1].text
    assert got.usage.completion_tokens == 32


def _flat(entries):
    """prompt_logprobs (Logprob objects or their JSON) -> ([(token, rank, piece)], [logprob])."""
    keys, values = [], []
    for position, entry in enumerate(entries):
        for token, e in (entry or {}).items():
            e = e if isinstance(e, dict) else vars(e)
            keys.append((position, int(token), e["rank"], e["decoded_token"]))
            values.append(e["logprob"])
    return keys, values


def test_prompt_logprobs_and_echoed_logprobs_are_llm_generates(servers, reference):
    """vLLM's extra `prompt_logprobs` (per completion choice, on the chat response) and completions'
    echo with logprobs (the prompt's tokens lead the choice's logprobs, the first one null)."""
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path, **body):
        status, got = servers[0].post(path, json.dumps(body).encode(), auth)
        assert status == 200, got
        return got

    want = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2,
                                                       prompt_logprobs=2))[0]
    got = post("/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, prompt_logprobs=2)["choices"][0]
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(want.prompt_token_ids)
    (keys, values), (want_keys, want_values) = _flat(got["prompt_logprobs"]), _flat(want.prompt_logprobs)
    assert keys == want_keys and len(keys) >= 2 * (len(want.prompt_token_ids) - 1)
    assert values == pytest.approx(want_values, rel=1e-5, abs=1e-6)
    assert got["logprobs"] is None

    echo = post("/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = echo["choices"][0]["logprobs"]
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    entries = want.prompt_logprobs + want.outputs[0].logprobs
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e[t].logprob for t, e in zip(ids[1:], entries[1:])],
                                                     rel=1e-5, abs=1e-6)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert echo["choices"][0]["text"] == PROMPT + want.outputs[0].text

    messages = [{"role": "user", "content": "fib"}]
    chat = post("/v1/chat/completions", messages=messages, max_tokens=2, temperature=0, prompt_logprobs=0)
    ids = post("/tokenize", messages=messages)["tokens"]
    chat_want = reference.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    (keys, values), (want_keys, want_values) = _flat(chat["prompt_logprobs"]), _flat(chat_want.prompt_logprobs)
    assert keys == want_keys and len(keys) == len(ids) - 1
    assert values == pytest.approx(want_values, rel=1e-5, abs=1e-6)


def test_cache_salt_keeps_prefix_cache_entries_apart(client):
    prompt = PROMPT * 4  # 41 tokens: 2 full blocks of 16
    usage = [client.completions.create(model="embedded", prompt=prompt, max_tokens=1, extra_body=extra).usage
             for extra in ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"})]
    cached = [u.prompt_tokens_details.cached_tokens for u in usage]
    assert cached[0] == 0 and cached[1] == 16 * (usage[1].prompt_tokens // 16) and cached[2] == 0


def test_chat_streamed_and_not_through_the_template(client, servers, reference):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fib"}]
    status, tokenized = servers[0].post("/tokenize", json.dumps({"messages": messages}).encode())
    prompt = "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\nfib<|im_end|>\n<|im_start|>assistant\n"
    assert status == 200
    assert tokenized["tokens"] == reference.get_tokenizer().encode(prompt, add_special_tokens=False)
    want = reference.generate([tokenized["tokens"]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    got = client.chat.completions.create(model="embedded", messages=messages, max_tokens=12, temperature=0.0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == tokenized["count"]
    chunks = list(client.chat.completions.create(model="embedded", messages=messages, max_tokens=12,
                                                 temperature=0.0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["int", "str"]}},
          "required": ["n", "kind"], "additionalProperties": False}


def test_structured_outputs_through_each_request_field(client, reference):
    """response_format json_schema (chat and completions, streamed and not), vLLM's
    structured_outputs and its older guided_choice: the server's text is LLM.generate's with the
    same StructuredOutputsParams, and it parses."""
    from paged_jax.structured_output import StructuredOutputsParams

    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    want = reference.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40,
                                                       structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    got = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=40, temperature=0.0,
                                    extra_body={"response_format": fmt})
    assert got.choices[0].text == want[0].outputs[0].text
    assert json.loads(got.choices[0].text).keys() == {"n", "kind"} and got.choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "an item"}]
    chat = client.chat.completions.create(model="embedded", messages=messages, max_tokens=40, temperature=0.0,
                                          response_format=fmt)
    streamed = client.chat.completions.create(model="embedded", messages=messages, max_tokens=40,
                                              temperature=0.0, response_format=fmt, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    # The tiny model pads JSON with whitespace (here up to max_tokens): vLLM's option turns that off.
    tight = client.chat.completions.create(model="embedded", messages=messages, max_tokens=40, temperature=0.0,
                                           extra_body={"structured_outputs": {"json": SCHEMA,
                                                                              "disable_any_whitespace": True}})
    assert json.loads(tight.choices[0].message.content)["kind"] in ("int", "str")
    assert tight.choices[0].finish_reason == "stop"
    for extra in ({"structured_outputs": {"choice": ["red", "green"]}}, {"guided_choice": ["red", "green"]}):
        got = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=8, temperature=0.7,
                                        seed=5, n=2, extra_body=extra)
        assert [c.text in ("red", "green") for c in got.choices] == [True, True]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}


def joined_tool_calls(chunks):
    """The calls a stream's deltas add up to (OpenAI's way: id and name first, arguments appended)."""
    calls = {}
    for chunk in chunks:
        for part in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] = (part.function.name if part.function else None) or call["name"]
            call["arguments"] += (part.function.arguments or "") if part.function else ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_parse_and_validate_streamed_and_not(client, tool_choice):
    import jsonschema

    kwargs = dict(model="embedded", messages=[{"role": "user", "content": "weather in Oslo?"}], max_tokens=64,
                  temperature=0.0, tools=[WEATHER, PING], tool_choice=tool_choice)
    got = client.chat.completions.create(**kwargs)
    message, choice = got.choices[0].message, got.choices[0]
    assert choice.finish_reason == "tool_calls" and message.content is None and message.tool_calls
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in (WEATHER, PING)}
    for call in message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = joined_tool_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_auto_renders_tools_and_tool_messages_through_the_template(client, reference):
    """tool_choice "auto" (hermes): the prompt holds the tools, an earlier call and its result as the
    template writes them; this model answers in text, which comes back as content."""
    tool = {"type": "function", "function": {"name": "f"}}  # small: the model's context is 256 tokens
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = ('<|im_start|>system\n# Tools\n' + json.dumps(tool) + '\n<|im_end|>\n<|im_start|>user\nweather?'
              '<|im_end|>\n<|im_start|>assistant\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
              '<|im_end|>\n<|im_start|>tool\n<tool_response>sunny</tool_response><|im_end|>\n<|im_start|>assistant\n')
    ids = reference.get_tokenizer().encode(prompt, add_special_tokens=False)
    want = reference.generate([ids], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    got = client.chat.completions.create(model="embedded", messages=messages, tools=[tool], max_tokens=16,
                                         temperature=0.0)
    assert got.usage.prompt_tokens == len(ids)
    assert (got.choices[0].message.content, got.choices[0].message.tool_calls) == (want.text, None)
    chunks = list(client.chat.completions.create(model="embedded", messages=messages, tools=[tool],
                                                 max_tokens=16, temperature=0.0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    none = client.chat.completions.create(model="embedded", messages=messages, tools=[tool], max_tokens=16,
                                          temperature=0.0, tool_choice="none")  # the same prompt, plain text
    assert (none.choices[0].message.content, none.choices[0].message.tool_calls) == (want.text, None)


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(servers, body, param):
    body = {"messages": [{"role": "user", "content": "x"}], **body}
    status, got = servers[0].post("/v1/chat/completions", json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"})
    assert (status, got["error"]["param"]) == (400, param), got
    status, got = servers[1].post("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}).encode())
    assert status == 400 and "--enable-auto-tool-choice" in got["error"]["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "nonsense"}}}}, 400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"prompt": "x", "guided_regex": "("}, 400, "guided_regex"),
    ({"prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}}, 400, "structured_outputs"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "model": "gpt-4"}, 404, None),
    ({"prompt": "x " * 300}, 400, "max_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "n": 33}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt": [5, 99999]}, 400, "prompt"),
    # The request model's own checks (pydantic, strict: true is not a number, 1.0 not an integer)
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": "x", "max_tokens": 2.0}, 400, "max_tokens"),
    ({"prompt": [5, "a"]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "stop": ["a", 3]}, 400, "stop"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
])
def test_bad_requests_get_openais_error_body_and_the_server_goes_on(servers, body, status, param):
    got_status, got = servers[0].post("/v1/completions", json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"})
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["code"] == status and got["error"]["param"] == param
    ok, answer = servers[0].post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}',
                                 {"Authorization": f"Bearer {KEY}"})
    assert ok == 200 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [{"content": "x"}]}, "messages", "messages.0.role: Field required"),
    ({"messages": []}, "messages", "messages: List should have at least 1 item"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "messages",
     "messages.0.content.list[TextPart].0.type: Input should be 'text'"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", "Input should be a valid boolean"),
])
def test_a_chat_body_its_model_refuses_is_400_naming_the_field(servers, body, param, message):
    """The chat request's model (pydantic): each error's path in the message, the field as param."""
    status, got = servers[0].post("/v1/chat/completions", json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"})
    assert (status, got["error"]["param"], got["error"]["type"]) == (400, param, "BadRequestError"), got
    assert message in got["error"]["message"], got


def test_fields_the_server_does_not_read_are_ignored(servers):
    """OpenAI's bodies may carry more than this server reads (vLLM accepts them too)."""
    status, got = servers[0].post("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "metadata": {"k": 1}}',
                                  {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and got["usage"]["completion_tokens"] == 2


def test_malformed_json_and_a_body_over_the_limit_are_400(servers):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body = servers[0].post("/v1/completions", b'{"prompt": "x",', auth)
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = servers[0].post("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}', auth)
    assert status == 400 and "limit" in body["error"]["message"]


def test_api_key(servers):
    a = servers[0]
    status, body = a.post("/v1/completions", b'{"prompt": "x"}')  # no Authorization header at all
    assert status == 401 and body["error"]["code"] == 401 and body["error"]["type"] == "AuthenticationError"
    wrong, right = (openai.OpenAI(base_url=a.url + "/v1", api_key=k, max_retries=0) for k in ("wrong", KEY))
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401
    assert [m.id for m in right.models.list().data] == ["embedded"]
    assert urllib.request.urlopen(a.url + "/health").status == 200
    assert urllib.request.urlopen(a.url + "/metrics").status == 200


def test_a_model_without_a_chat_template_gets_a_clear_400(servers, reference):
    b = openai.OpenAI(base_url=servers[1].url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        b.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert b.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
    status, body = servers[1].post("/detokenize", json.dumps({"tokens": [5, 6]}).encode())
    assert status == 200 and body["prompt"] == reference.get_tokenizer().decode([5, 6])
    assert re.search(r"warm-up compiled [1-9][0-9]* programs \(0 read from the compilation cache\) in",
                     servers[1].output())


def test_the_server_listens_and_serves_while_it_warms_up_and_health_says_so(servers):
    """The warm-up compiles in the background: /health's first answer, as soon as the port
    listened, is 503 with the warm-up's progress; a completion sent then is served (compiling what it
    needs, or waiting for the warm-up's copy of it); /health turns 200 when the warm-up ends."""
    first, (status, body) = servers[1].warming
    assert first["status"] == 503, first
    progress = first["body"]
    assert progress["status"] == "warming up" and 0 <= progress["programs_compiled"] < progress["programs"], progress
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert urllib.request.urlopen(servers[1].url + "/health").status == 200


def test_metrics_count_what_llm_stats_counts(servers, reference):
    a = servers[0]
    prompts = [PROMPT, PROMPT + "    if n < 2:\n", "import os\n"]
    before = a.metrics()
    stats0 = reference.stats()
    for p in prompts:
        a.post("/v1/completions", json.dumps({"prompt": p, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                                              "cache_salt": "metrics"}).encode(), {"Authorization": f"Bearer {KEY}"})
    for p in prompts:  # one at a time, as the server got them
        reference.generate([{"prompt": p, "cache_salt": "metrics"}],
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    after, stats = a.metrics(), reference.stats()
    for key in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        name = f"vllm:{key}_total"
        assert after[name, None] - before[name, None] == stats[key] - stats0[key], key
    assert after["vllm:request_success_total", "length"] - before["vllm:request_success_total", "length"] == 3
    assert after["vllm:e2e_request_latency_seconds_count", None] - before[
        "vllm:e2e_request_latency_seconds_count", None] == 3


async def _load(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)

    async def complete(i):
        max_tokens = 8 + (i * 37) % 57
        stream = await client.completions.create(
            model="embedded", prompt=f"{i}: " + PROMPT * (1 + i % 3), max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, temperature=0.8, seed=i)
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return max_tokens, usage.completion_tokens, text

    async def leave(i):
        stream = await client.completions.create(model="embedded", prompt=PROMPT, max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True}, seed=100 + i)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()
        return seen

    results = await asyncio.gather(*(complete(i) for i in range(64)))
    left = await asyncio.gather(*(leave(i) for i in range(16)))
    await client.close()
    return results, left


def test_64_streams_under_preemption_then_16_that_leave(servers):
    a = servers[0]
    preemptions = a.metrics()["vllm:num_preemptions_total", None]
    results, left = asyncio.run(_load(a.url))
    assert [got for _, got, _ in results] == [want for want, _, _ in results]
    assert all(text for _, _, text in results)
    assert left == [2] * 16
    assert a.metrics()["vllm:num_preemptions_total", None] > preemptions
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the aborts reach the engine thread within a step
        m = a.metrics()
        if m["vllm:num_requests_running", None] == 0 and m["vllm:kv_cache_usage_perc", None] == 0:
            break
        time.sleep(0.2)
    assert (m["vllm:num_requests_running", None], m["vllm:num_requests_waiting", None],
            m["vllm:kv_cache_usage_perc", None]) == (0, 0, 0)
    assert m["vllm:request_success_total", "abort"] >= 16


def test_benchmark_serving_end_to_end(servers, capsys):
    from scripts import benchmark_serving

    summary = benchmark_serving.main(["--url", servers[1].url, "--num-prompts", "6", "--request-rate", "50",
                                      "--input-len-mean", "8", "--input-len-max", "16", "--output-len-mean", "8",
                                      "--output-len-max", "16", "--vocab-size", "4096"])
    assert (summary["completed"], summary["failed"], summary["length_mismatches"]) == (6, 0, 0)
    assert summary["output_throughput"] > 0 and summary["p99_ttft_ms"] >= summary["median_ttft_ms"] > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_an_error_inside_a_stream_is_an_error_chunk_then_done():
    from paged_jax.entrypoints.openai.protocol import Options
    from paged_jax.entrypoints.openai.response import ChoicesResponse
    from tests.paged_jax.engine_testing import StubServing, dying_outputs

    async def collect():
        options = Options(model=None, stream=True, include_usage=True, logprobs=None, prompt_logprobs=None,
                          echo=False, cache_salt=None)
        response = ChoicesResponse(StubServing(), "cmpl-1", False, 1, [[1, 2]], options, token_ids_as_tokens=False)
        return [line async for line in response.events(dying_outputs())]

    lines = asyncio.run(collect())
    assert [json.loads(line[6:])["choices"][0]["text"] for line in lines[:1]] == ["ab"]
    assert json.loads(lines[1][6:]) == {"error": {"message": "the engine stopped: boom", "type": "InternalServerError",
                                                  "param": None, "code": 500}}
    assert lines[2:] == ["data: [DONE]\n\n"]


@pytest.mark.parametrize("flags, named", [(["--kv-cache-dtype", "int4"], "int4"),
                                          (["--preemption-mode", "offload"], "offload"),
                                          (["--swap-space", "-1"], "swap_space"),
                                          (["--enable-host-prefix-cache", "--no-enable-prefix-caching"],
                                           "enable_prefix_caching"),
                                          (["--tokenizer", "/no/such/dir"], "tokenizer='/no/such/dir' has no tokenizer"),
                                          (["--max-stored-responses", "-1"], "--max-stored-responses must be >= 0, got -1")])
def test_engine_flags_reach_the_engine_and_a_bad_one_is_one_line_and_exit_2(flags, named, capsys, monkeypatch):
    import uvicorn

    from paged_jax.entrypoints.openai import cli

    def run(*args, **kwargs):
        raise AssertionError(f"the server started: {flags} did not reach the engine")

    monkeypatch.setattr(uvicorn, "run", run)
    with pytest.raises(SystemExit) as e:
        cli.main([*flags, "--no-compilation-cache", "--warmup-prompt-len", "0", "--port", str(free_port())])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].startswith("paged-jax-serve: error: ") and named in err[0]
