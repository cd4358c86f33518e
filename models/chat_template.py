"""Chat templates: a checkpoint's Jinja template rendered the way Hugging Face transformers renders it.

The environment is transformers' (`utils/chat_template_utils.py`): a sandbox whose globals cannot be
rebound, `trim_blocks`/`lstrip_blocks` (templates on the Hub are written for them), `{% break %}`,
`{% continue %}` and `{% generation %}`, a `tojson` that does not HTML-escape, and the `raise_exception`/`strftime_now`
globals. What the template is given is transformers' too, so the same messages give the same prompt."""
from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own filter escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: it marks the assistant's text for
    `return_assistant_tokens_mask`; the prompt is the block's text, unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool,
                         bos_token: str | None, eos_token: str | None, **extra) -> str:
    """The prompt `template` writes for `messages`; `extra` (tools, documents, template flags such as
    `enable_thinking`) reaches the template as variables. Raises ValueError with the template's
    message when it calls `raise_exception`, does not compile or fails to render."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty list of messages")
    # transformers drops None-valued keys: OpenAI clients send `"tool_calls": null`, and templates
    # test `is defined`. A None token is left undefined too (it renders as "", not "None").
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    # tools/documents are None, not undefined, when absent: templates test `tools is not none`.
    variables = {"tools": None, "documents": None, **tokens, **extra}
    try:
        return _compile(template).render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:  # raise_exception, a syntax error, an undefined name
        raise ValueError(str(e)) from e
    except Exception as e:  # the template is code from the checkpoint: e.g. str + list on bad content
        raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e
