"""`POST /v1/responses`, `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` (OpenAI's
Responses API, as vLLM serves it): the request becomes a chat request (responses_protocol.py) that
runs through the chat path, and its choice becomes a response's output items (a message with
`output_text`, then one `function_call` item per call), streamed as OpenAI's typed events.

A stored response (`store`, the default) is kept with its conversation, so that a request naming
it as `previous_response_id` continues it: the new prompt is the new `instructions` (those of
earlier responses are not carried over, as OpenAI says), the earlier turns' messages, their
answers (text and calls), then the new `input`. The store holds the newest `--max-stored-responses`
responses in memory (vLLM keeps every one, or none by default); an older or unknown id is a 404.
"""
from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator

from paged_jax.entrypoints.async_llm import EngineDeadError
from paged_jax.entrypoints.openai.protocol import APIError, engine_dead
from paged_jax.entrypoints.openai.response import ChoicesResponse
from paged_jax.entrypoints.openai.responses_protocol import (ResponsesRequest, chat_request, input_messages,
                                                             renamed)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status=404, param=param, type="NotFoundError")


class ResponseStore:
    """The newest `capacity` stored responses: id -> (response body, its conversation as chat
    messages without instructions, its answer included). Entries share the message dicts of the
    responses they continue, so a long chain costs one list of references per turn."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {capacity}")
        self.capacity = capacity
        self.entries: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, body: dict, messages: list[dict]) -> None:
        self.entries[body["id"]] = (body, messages)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, *, param: str = "response_id") -> tuple[dict, list[dict]]:
        entry = self.entries.get(response_id)  # one lookup: the event loop may drop it meanwhile
        if entry is None:
            raise _not_found(response_id, param)
        return entry

    def delete(self, response_id: str) -> dict:
        if self.entries.pop(response_id, None) is None:
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


class Responses:
    """The endpoint over a chat `Serving`."""

    def __init__(self, serving, max_stored: int):
        self.serving, self.store = serving, ResponseStore(max_stored)

    async def create(self, body: dict) -> dict | AsyncIterator[str]:
        """-> the response body, or its events (SSE lines) when it streams."""
        request, conversation, chat = await self.serving.off_loop(self._translate, body)
        try:
            choices, outputs = await self.serving.submit(chat)
        except APIError as e:
            raise renamed(e) from None
        stored = request.store and self.store.capacity > 0
        response = ResponseBody(request, choices, stored=stored)

        def finished(body: dict) -> None:
            if stored:
                self.store.put(body, conversation + [response.answer()])

        if request.stream:
            return response.events(outputs, finished)
        try:
            await self.serving.collect(choices, outputs)
        except APIError as e:
            raise renamed(e) from None
        body = response.body()
        finished(body)
        return body

    def _translate(self, body: dict):
        """On the worker pool -> (the request, its conversation without instructions, the chat request)."""
        request = ResponsesRequest.parse(body)
        request.check()
        previous = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, param="previous_response_id")[1]
        conversation = previous + input_messages(request)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        return request, conversation, chat_request(request, system + conversation)


def _hex_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseBody:
    """One response's body and events, from its chat choice (one: a response has no `n`)."""

    def __init__(self, request: ResponsesRequest, choices: ChoicesResponse, *, stored: bool):
        self.request, self.choices, self.stored = request, choices, stored
        self.id, self.created_at = _hex_id("resp_"), int(time.time())
        self.items: list[dict] = []  # output items, in order
        self.logprobs = choices.options.logprobs is not None
        self.sequence, self.open = 0, None  # streaming: the next event's number, the item being written

    @property
    def status(self) -> str:
        return "incomplete" if self.choices.finish[0] == "length" else "completed"

    def snapshot(self, status: str, *, error: dict | None = None) -> dict:
        request, done = self.request, status in ("completed", "incomplete")
        usage = self.choices.usage()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.choices.model, "output": self.items if done else [],
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
            "reasoning": None, "store": self.stored,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p, "top_logprobs": request.top_logprobs,
            "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": request.tool_choice if isinstance(request.tool_choice, str) else
            request.tool_choice.model_dump(),
            "tools": [tool.model_dump() for tool in request.tools], "truncation": request.truncation,
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]} if done else None,
            "user": request.user, "metadata": request.metadata or {},
        }

    def body(self) -> dict:
        """The whole response of a request that did not stream."""
        text = self.choices.text[0]
        content, calls = self.choices.tools.message(text) if self.choices.tools is not None else (text, [])
        if content or not calls:
            self.items.append(self._message(content or "", self.choices.logprobs[0] if self.logprobs else []))
        for call in calls:
            self.items.append(self._call(call["function"]["name"], call["function"]["arguments"]))
        for item in self.items:
            item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        return self.snapshot(self.status)

    def answer(self) -> dict:
        """The output as the assistant's chat message (what a later turn's prompt shows)."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        return {"role": "assistant", "content": text if text or not calls else None,
                **({"tool_calls": calls} if calls else {})}

    @staticmethod
    def _message(text: str, logprobs: list) -> dict:
        return {"id": _hex_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}

    @staticmethod
    def _call(name: str, arguments: str) -> dict:
        return {"id": _hex_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": _hex_id("call_"),
                "name": name, "arguments": arguments}

    # -- streaming ------------------------------------------------------------------------------

    async def events(self, outputs, finished) -> AsyncIterator[str]:
        """OpenAI's events: created, in_progress, each item's added / deltas / done (a message's
        content part inside it), then completed (or incomplete: max_output_tokens was reached);
        `finished(body)` is called with the final body. An error is an `error` event, then
        `response.failed`. No `[DONE]` (OpenAI sends none for responses)."""
        try:
            yield self._event("response.created", response=self.snapshot("in_progress"))
            yield self._event("response.in_progress", response=self.snapshot("in_progress"))
            tools = self.choices.tools.stream() if self.choices.tools is not None else None
            pending: list = []  # logprobs not yet sent: they go with the next text delta
            async for i, out in outputs:
                for _, new, logprobs, c in self.choices.add(i, out):
                    pending += logprobs["content"] if logprobs else []
                    if tools is None:
                        deltas = [{"content": new}]
                    else:
                        deltas = tools.feed(new) + (tools.finish() if c.finish_reason is not None else [])
                    for delta in deltas:
                        for line in self._delta(delta, pending):
                            yield line
            if pending and self.open is not None and self.open["type"] == "message":
                self.open["content"][0]["logprobs"] += pending  # tokens whose text a stop string cut
            for line in self._close():
                yield line
            if not self.items:  # no text and no calls: an empty message, as the unstreamed body has
                for line in [*self._open_message(), *self._close()]:
                    yield line
            final = self.snapshot(self.status)
            finished(final)
            yield self._event(f"response.{self.status}", response=final)
        except (APIError, ValueError, EngineDeadError) as e:
            error = e if isinstance(e, APIError) else APIError(str(e)) if isinstance(e, ValueError) else engine_dead(e)
            yield self._event("error", code=error.type, message=error.message, param=error.param)
            yield self._event("response.failed", response=self.snapshot(
                "failed", error={"code": "server_error", "message": error.message}))
        finally:
            await outputs.aclose()

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _delta(self, delta: dict, pending: list) -> list[str]:
        """The events of one chat delta: text for the open message (opened if need be), or a
        call's header (a new function_call item) or its arguments' next piece."""
        lines = []
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                lines += self._close() + self._open_message()
            part = self.open["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += pending
            lines.append(self._event("response.output_text.delta", **self._where(self.open), content_index=0,
                                     delta=delta["content"], logprobs=list(pending)))
            pending.clear()
        for call in delta.get("tool_calls", ()):
            function = call.get("function") or {}
            if "id" in call:
                lines += self._close()
                self.open = self._call(function["name"], "")
                lines += self._added()
            if function.get("arguments"):
                self.open["arguments"] += function["arguments"]
                lines.append(self._event("response.function_call_arguments.delta", **self._where(self.open),
                                         delta=function["arguments"]))
        return lines

    def _where(self, item: dict) -> dict:
        """The open item's place (it is the last one)."""
        return {"item_id": item["id"], "output_index": len(self.items) - 1}

    def _added(self) -> list[str]:
        self.items.append(self.open)
        added = {**self.open, **({"content": []} if self.open["type"] == "message" else {})}
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _open_message(self) -> list[str]:
        self.open = self._message("", [])
        return self._added() + [self._event("response.content_part.added", **self._where(self.open), content_index=0,
                                            part={"type": "output_text", "text": "", "annotations": [],
                                                  "logprobs": []})]

    def _close(self) -> list[str]:
        """The done events of the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item)
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        lines = []
        if item["type"] == "message":
            part = item["content"][0]
            lines += [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=part["logprobs"] if self.logprobs else []),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            lines.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        lines.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        return lines
