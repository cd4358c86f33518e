"""OpenAI's Responses API (`/v1/responses`) end to end: a real server with the embedded model and a
ChatML template, driven by the `openai` client, each response checked against the chat completion
of the same conversation (its prompt's tokens and its text) and its raw JSON validated by the
`openai` package's own types (strict pydantic validation, not the client's lenient parsing)."""
import asyncio
import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from tests.paged_jax.test_openai_server import CHATML, ENGINE, Server  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    (tmp / "chat.jinja").write_text(CHATML)
    s = Server(tmp, "--chat-template", str(tmp / "chat.jinja"), "--enable-auto-tool-choice", "--tool-call-parser",
               "hermes", "--max-stored-responses", "8", *[f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()])
    try:
        yield s.wait()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def call(server, method, path, body=None):
    """(status, JSON body) of a raw request."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(server, body) -> list[dict]:
    """A streamed response's events, each checked against its SSE `event:` line."""
    request = urllib.request.Request(server.url + "/v1/responses", data=json.dumps({**body, "stream": True}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        frames = r.read().decode().split("\n\n")
    assert frames[-1] == ""  # every frame ends with a blank line, and no `data: [DONE]` follows
    out = []
    for frame in frames[:-1]:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event)
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def prompt_tokens(server, messages) -> int:
    status, body = call(server, "POST", "/tokenize", {"messages": messages})
    assert status == 200
    return body["count"]


def test_a_response_is_the_chat_completion_of_its_conversation(server, client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fib"}]
    chat = client.chat.completions.create(model="embedded", messages=messages, max_tokens=12, temperature=0.0)
    status, body = call(server, "POST", "/v1/responses", {
        "model": "embedded", "input": "fib", "instructions": "You write Python.", "max_output_tokens": 12,
        "temperature": 0.0, "metadata": {"k": "v"}})
    assert status == 200
    response = Response.model_validate(body)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    [message] = response.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "incomplete", "msg_")
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        prompt_tokens(server, messages), 12, prompt_tokens(server, messages) + 12)
    assert (response.instructions, response.max_output_tokens, response.temperature, response.metadata) == (
        "You write Python.", 12, 0.0, {"k": "v"})
    # The same conversation as items: a developer message is a system message, content parts are joined.
    items = client.responses.create(model="embedded", max_output_tokens=12, temperature=0.0, input=[
        {"role": "developer", "content": "You write Python."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "f"},
                                                        {"type": "input_text", "text": "ib"}]}])
    assert (items.output_text, items.usage.input_tokens) == (response.output_text, response.usage.input_tokens)


def test_streamed_events_build_the_unstreamed_response(server, client):
    kwargs = {"input": "def fibonacci(n):", "max_output_tokens": 24, "temperature": 0.0,
              "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    body = {**kwargs, "stop": ["single"]}  # vLLM's extra field
    whole = client.responses.create(**kwargs, extra_body={"stop": body["stop"]})
    assert whole.status == "completed"  # the stop string ended it
    got = events(server, body)
    kinds = [e["type"] for e in got]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"] and deltas >= 2
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == got[-4]["text"]
    final = Response.model_validate(got[-1]["response"])
    assert final.output[0].id == got[2]["item"]["id"] == got[4]["item_id"] and final.output_text == text
    assert got[-1]["response"]["output"] == [got[-2]["item"]]
    # Logprobs: each token's, in chat's shape, spread over the deltas and whole in the final part.
    streamed = [lp for e in got if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert streamed == got[-4]["logprobs"] == final.output[0].content[0].model_dump()["logprobs"]
    assert [lp.token for lp in whole.output[0].content[0].logprobs] == [lp["token"] for lp in streamed]
    assert all(len(lp["top_logprobs"]) == 2 for lp in streamed)
    assert final.usage.output_tokens == whole.usage.output_tokens == len(streamed)
    # The SDK's own stream helper accepts the events and rebuilds the same response.
    with client.responses.stream(model="embedded", **kwargs, extra_body={"stop": body["stop"]}) as stream:
        assert stream.get_final_response().output_text == text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_function_calls_are_items_streamed_and_not(server, client, tool_choice):
    import jsonschema

    body = {"input": "weather in Oslo?", "tools": [WEATHER], "tool_choice": tool_choice, "max_output_tokens": 48,
            "temperature": 0.0}
    response = client.responses.create(**body)
    chat = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "weather in Oslo?"}],
                                          tools=[CHAT_WEATHER], max_tokens=48, temperature=0.0,
                                          tool_choice=tool_choice if tool_choice == "required" else
                                          {"type": "function", "function": {"name": "get_weather"}})
    assert [(i.type, i.name, i.arguments) for i in response.output] == [
        ("function_call", c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls]
    assert response.status == "completed" and response.output_text == ""
    for item in response.output:
        assert item.call_id.startswith("call_") and item.id.startswith("fc_") and item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    got = events(server, body)
    assert [e["type"] for e in got[2:3] + got[-3:]] == [
        "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert got[2]["item"]["arguments"] == "" and got[2]["item"]["status"] == "in_progress"
    arguments = "".join(e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta")
    assert arguments == got[-3]["arguments"] == response.output[0].arguments
    assert got[-1]["response"]["output"] == [got[-2]["item"]]


def test_parallel_tool_calls_false_makes_one_call_as_chat_does(client):
    """The same request with parallel_tool_calls false: the first of the two calls only (the
    grammar allows one), as the chat endpoint gives for the same flag."""
    ping = {"type": "function", "name": "ping"}
    kwargs = dict(input="ping", tools=[WEATHER, ping], tool_choice="required", max_output_tokens=64, temperature=0.0)
    many = client.responses.create(**kwargs)
    one = client.responses.create(**kwargs, parallel_tool_calls=False)
    assert len(many.output) == 2 and one.parallel_tool_calls is False
    assert [(i.name, i.arguments) for i in one.output] == [(many.output[0].name, many.output[0].arguments)]
    chat = client.chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "ping"}], max_tokens=64, temperature=0.0,
        tools=[CHAT_WEATHER, {"type": "function", "function": {"name": "ping"}}], tool_choice="required",
        parallel_tool_calls=False)
    assert [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls] == [
        (one.output[0].name, one.output[0].arguments)]


def test_previous_response_id_continues_the_conversation_and_its_calls(server, client):
    first = client.responses.create(input="fib", instructions="Be brief.", max_output_tokens=6, temperature=0.0)
    second = client.responses.create(input="more", instructions="Be kind.", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0.0)
    # The earlier instructions are not carried over (OpenAI's rule); its answer is.
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "fib"},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "more"}]
    chat = client.chat.completions.create(model="embedded", messages=messages, max_tokens=6, temperature=0.0)
    assert second.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(server, messages)
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    # A call, then its output as an item: the prompt holds both as the template writes them.
    called = client.responses.create(input="weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=48, temperature=0.0)
    answer = client.responses.create(previous_response_id=called.id, tools=[WEATHER], max_output_tokens=8,
                                     temperature=0.0, input=[{"type": "function_call_output",
                                                              "call_id": called.output[0].call_id, "output": "sunny"}])
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in called.output]
    chat = client.chat.completions.create(model="embedded", tools=[CHAT_WEATHER], max_tokens=8, temperature=0.0,
                                          messages=[{"role": "user", "content": "weather in Oslo?"},
                                                    {"role": "assistant", "content": None, "tool_calls": calls},
                                                    {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content


def test_stored_responses_are_retrieved_deleted_and_the_oldest_dropped(server, client):
    kept = client.responses.create(input="a", max_output_tokens=2, temperature=0.0)
    status, body = call(server, "GET", f"/v1/responses/{kept.id}")
    assert status == 200 and body == kept.model_dump(exclude_unset=True) and body["store"] is True
    unkept = client.responses.create(input="a", max_output_tokens=2, temperature=0.0, store=False)
    assert unkept.store is False
    status, body = call(server, "GET", f"/v1/responses/{unkept.id}")
    assert (status, body["error"]["param"]) == (404, "response_id")
    status, body = call(server, "POST", "/v1/responses", {"input": "b", "previous_response_id": unkept.id})
    assert (status, body["error"]["param"]) == (404, "previous_response_id")
    assert f"'{unkept.id}' not found" in body["error"]["message"]
    assert call(server, "DELETE", f"/v1/responses/{kept.id}") == (200, {"id": kept.id, "object": "response",
                                                                       "deleted": True})
    assert call(server, "GET", f"/v1/responses/{kept.id}")[0] == 404
    ids = [client.responses.create(input="c", max_output_tokens=1).id for _ in range(9)]  # the store holds 8
    assert [call(server, "GET", f"/v1/responses/{i}")[0] for i in ids] == [404] + [200] * 8


def test_text_format_json_schema_is_the_chat_response_format(client):
    # An object: the tiny model pads it with whitespace up to max_tokens; a pair of digits ends.
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}
    response = client.responses.create(input="a number", max_output_tokens=40, temperature=0.0,
                                       text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    chat = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "a number"}],
                                          max_tokens=40, temperature=0.0, response_format={
                                              "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert response.output_text == chat.choices[0].message.content
    assert len(json.loads(response.output_text)) == 2 and response.status == "completed"
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "input_image", "image_url": "u"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}},
     400, "text"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "prompt": {"id": "p"}}, 400, "prompt"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x " * 300}, 400, "input"),
    ({"input": "x", "max_output_tokens": 250}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": -1.0}, 400, "temperature"),
    ({"input": "x", "top_k": "a"}, 400, "top_k"),
    ({"input": "x", "model": "gpt-4"}, 404, None),
])
def test_bad_requests_are_openais_error_naming_the_field_and_the_server_goes_on(server, body, status, param):
    got_status, got = call(server, "POST", "/v1/responses", body)
    assert (got_status, got["error"]["param"], got["error"]["code"]) == (status, param, status), got
    ok, answer = call(server, "POST", "/v1/responses", {"input": "x", "max_output_tokens": 2})
    assert ok == 200 and answer["usage"]["output_tokens"] == 2


def test_input_items_become_chat_messages():
    from paged_jax.entrypoints.openai.responses_protocol import ResponsesRequest, input_messages

    request = ResponsesRequest.parse({"input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}', "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]})
    assert input_messages(request) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_an_error_inside_a_stream_is_an_error_event_then_failed():
    from paged_jax.entrypoints.openai.protocol import ChatCompletionRequest, read_options
    from paged_jax.entrypoints.openai.response import ChoicesResponse
    from paged_jax.entrypoints.openai.responses import ResponseBody
    from paged_jax.entrypoints.openai.responses_protocol import ResponsesRequest
    from tests.paged_jax.engine_testing import StubServing, dying_outputs

    async def collect():
        options = read_options(ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "x"}],
                                                            "stream": True}))
        choices = ChoicesResponse(StubServing(), "c", True, 1, [[1, 2]], options, token_ids_as_tokens=False)
        response = ResponseBody(ResponsesRequest.parse({"input": "x", "stream": True}), choices, stored=True)
        return [json.loads(line.split("\ndata: ")[1]) async for line in response.events(dying_outputs(), print)]

    got = asyncio.run(collect())
    assert [e["type"] for e in got] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta", "error",
                                        "response.failed"]
    assert (got[5]["code"], got[5]["message"]) == ("InternalServerError", "the engine stopped: boom")
    assert got[6]["response"]["status"] == "failed" and got[6]["response"]["error"]["code"] == "server_error"
    for event in got:
        EVENTS.validate_python(event)


def test_the_store_keeps_the_newest_and_refuses_a_negative_size():
    from paged_jax.entrypoints.openai.protocol import APIError
    from paged_jax.entrypoints.openai.responses import ResponseStore

    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert list(store.entries) == ["r1", "r2"] and store.get("r2")[1] == [{"role": "user", "content": "2"}]
    with pytest.raises(APIError, match="'r0' not found"):
        store.get("r0")
    with pytest.raises(ValueError, match="max_stored_responses must be >= 0, got -1"):
        ResponseStore(-1)
