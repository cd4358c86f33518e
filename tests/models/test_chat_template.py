"""Chat templates rendered as transformers renders them, and read from a checkpoint directory."""
import json
import shutil
from pathlib import Path

import jinja2
import pytest

from models.chat_template import render_chat_template
from models.tokenizer import load_tokenizer

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "embedded"

# Meta-Llama-3-8B-Instruct's template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# SmolLM2-Instruct's ChatML template (Qwen2's differs only in the default system prompt).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
# Mistral-Instruct-v0.1's template: alternating roles, raise_exception otherwise.
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")
# Written on indented lines, so its output depends on trim_blocks/lstrip_blocks; uses tojson,
# `{% continue %}`, `tools is not none` and a key that transformers drops when None.
TOOLS = """{% if tools is not none %}
<|im_start|>system
{{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role == 'ignored' %}
        {% continue %}
    {% endif %}
<|im_start|>{{ message.role }}
    {% if message.tool_calls is defined %}
{{ message.tool_calls | tojson(indent=2) }}
    {% else %}
{{ message.content }}
    {% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
# SmolLM3's and Qwen3's kind: `{% generation %}` marks the assistant's turns (transformers' extension).
GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOKENS = {GENERATION: ("<|im_start|>", "<|im_end|>"), LLAMA3: ("<|begin_of_text|>", "<|eot_id|>"), CHATML: ("<|im_start|>", "<|im_end|>"),
          MISTRAL: ("<s>", "</s>"), TOOLS: (None, "<|im_end|>")}

USER = [{"role": "user", "content": "Write a haiku about paged attention."}]
MULTI_TURN = [
    {"role": "system", "content": "You are terse. Answer in <b>one</b> line: é & ü."},
    {"role": "user", "content": "  What is a KV cache?  "},
    {"role": "assistant", "content": "Keys and values of past tokens.", "tool_calls": None},
    {"role": "user", "content": "And a block table?"},
]
TOOL_CALL = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "ignored", "content": "never rendered"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich <&>"}}}]},
    {"role": "tool", "content": "12°C"},
]
WEATHER = [{"type": "function", "function": {"name": "weather", "description": "Now, at a <city>.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def hf_tokenizer(template):
    transformers = pytest.importorskip("transformers")
    bos, eos = TOKENS[template]
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(EMBEDDED / "tokenizer.json"),
                                                chat_template=template, bos_token=bos, eos_token=eos)


def ours(template, messages, **kwargs):
    bos, eos = TOKENS[template]
    return render_chat_template(template, messages, bos_token=bos, eos_token=eos, **kwargs)


# The other templates concatenate content, which TOOL_CALL leaves out (None) for its tool call.
CASES = {f"{t_name}-{m_name}": (template, messages)
         for t_name, template in (("llama3", LLAMA3), ("chatml", CHATML), ("tools", TOOLS),
                                  ("generation", GENERATION))
         for m_name, messages in (("user", USER), ("multi_turn", MULTI_TURN), ("tool_call", TOOL_CALL))
         if template is TOOLS or messages is not TOOL_CALL}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template, messages", CASES.values(), ids=CASES.keys())
def test_renders_as_transformers(template, messages, add_generation_prompt):
    expected = hf_tokenizer(template).apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours(template, messages, add_generation_prompt=add_generation_prompt) == expected


def test_the_generation_block_renders_its_text():
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ours(GENERATION, turns, add_generation_prompt=True) == (  # trim_blocks eats each block's newline
        "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nhello<|im_end|><|im_start|>assistant\n")


def test_tools_and_extra_variables_as_transformers():
    expected = hf_tokenizer(TOOLS).apply_chat_template(TOOL_CALL, tools=WEATHER, add_generation_prompt=True,
                                                       tokenize=False)
    assert ours(TOOLS, TOOL_CALL, add_generation_prompt=True, tools=WEATHER) == expected
    assert '"Now, at a <city>."' in expected and '"Zürich <&>"' in expected  # not HTML-escaped


def test_llama3_exact_prompt():
    assert ours(LLAMA3, MULTI_TURN[:2], add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You are terse. Answer in <b>one</b> line: é & ü.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a KV cache?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_raise_exception_gives_value_error_with_the_template_message():
    good = [USER[0], {"role": "assistant", "content": "Blocks of keys."}, USER[0]]
    assert ours(MISTRAL, good, add_generation_prompt=False) == hf_tokenizer(MISTRAL).apply_chat_template(
        good, tokenize=False)
    bad = [USER[0], {"role": "tool", "content": "12°C"}]
    with pytest.raises(ValueError, match=r"^Only user and assistant roles are supported!$"):
        ours(MISTRAL, bad, add_generation_prompt=False)
    with pytest.raises(jinja2.TemplateError,
                       match="Only user and assistant roles are supported!"):
        hf_tokenizer(MISTRAL).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="^Conversation roles must alternate"):
        ours(MISTRAL, MULTI_TURN, add_generation_prompt=False)


def test_broken_templates_give_value_error():
    with pytest.raises(ValueError, match="^Unexpected end of template"):
        render_chat_template("{% for m in messages %}", USER, add_generation_prompt=True,
                             bos_token=None, eos_token=None)
    with pytest.raises(ValueError, match="TypeError"):  # str + list
        render_chat_template("{{ 'x' + messages }}", USER, add_generation_prompt=True,
                             bos_token=None, eos_token=None)
    with pytest.raises(ValueError, match="empty"):
        render_chat_template(CHATML, [], add_generation_prompt=True, bos_token=None, eos_token=None)


def copy_embedded(directory):
    directory.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(EMBEDDED / name, directory / name)
    return directory


def test_embedded_tokenizer_has_no_chat_template():
    tok = load_tokenizer(EMBEDDED)
    assert tok.chat_template is None
    assert tok.bos_token == tok.eos_token == "<|endoftext|>"  # from bos/eos_token_id 0
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(USER)


BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"


def test_load_tokenizer_reads_tokenizer_config(tmp_path):
    directory = copy_embedded(tmp_path / "ckpt")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "unused"},
                          {"name": "default", "template": BOS_TEMPLATE}]}))
    tok = load_tokenizer(directory)
    assert tok.chat_template == BOS_TEMPLATE
    assert (tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    prompt = tok.apply_chat_template(USER)
    assert prompt == "<|endoftext|>user: Write a haiku about paged attention.<|im_end|>"
    ids = tok.apply_chat_template(USER, tokenize=True)
    assert ids == tok.encode(prompt, add_special_tokens=False) and ids[:2] != [0, 0] and ids[0] == 0
    assert tok.encode(prompt)[:2] == [0, 0]  # what add_special_tokens would have done
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    assert hf.apply_chat_template(MULTI_TURN, add_generation_prompt=True, tokenize=False) == (
        tok.apply_chat_template(MULTI_TURN))


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    directory = copy_embedded(tmp_path / "ckpt")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "unused"}))
    (directory / "chat_template.jinja").write_text(CHATML)
    tok = load_tokenizer(directory)
    assert tok.chat_template == CHATML
    assert tok.apply_chat_template(USER, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWrite a haiku about paged attention.<|im_end|>\n")
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    assert hf.apply_chat_template(MULTI_TURN, add_generation_prompt=True, tokenize=False) == (
        tok.apply_chat_template(MULTI_TURN))
