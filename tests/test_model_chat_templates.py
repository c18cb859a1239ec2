"""Chat templates in each family's turn format render as transformers renders them (issue 27).

The templates are written here in the shape each family's tokenizer_config.json uses (the real ones are not on
this machine): Llama 3's header tokens and system merge, Mistral's [INST] with alternation enforced by
raise_exception, Qwen3's im_start turns with tools as JSON lines and <think> stripped from past answers,
Gemma's start_of_turn with the system prompt folded into the first user turn and role "model", Phi-3's
<|user|> ... <|end|>, SmolLM3's system block with reasoning flags. Each is rendered by prefixserve's tokenizer and
by transformers' apply_chat_template from the same directory, for several conversations, with and without the
generation prompt and tools; a conversation a template refuses is refused by both.
"""

from __future__ import annotations

import json
import shutil

import pytest

from prefixserve.model import Tokenizer, ensure_default_model

transformers = pytest.importorskip("transformers")

TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set system = 'You are a helpful assistant.' %}{% endif %}"
        "<|start_header_id|>system<|end_header_id|>\n\n{{ system }}"
        "{% if tools %}\n\nTools:\n{% for tool in tools %}{{ tool | tojson(indent=4) }}\n{% endfor %}{% endif %}"
        "<|eot_id|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
    ),
    "qwen3": (
        "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
        "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
        "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
        "{%- endif %}\n{%- set ns = namespace(last_user=-1) %}"
        "{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
        "{% endfor %}{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{% continue %}"
        "{%- endif %}{%- set content = message.content %}"
        "{%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
        "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
        "<|im_start|>{{ message.role }}\n{{ content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n"
        "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{%- endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
        "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
        "{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}{% elif message['role'] == 'user' %}"
        "{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}{% elif message['role'] == 'assistant' %}"
        "{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
    "smollm3": (
        "{%- set reasoning = '/no_think' if (enable_thinking is defined and not enable_thinking) else '/think' %}"
        "<|im_start|>system\n## Metadata\n\nReasoning Mode: {{ reasoning }}\n\n## Custom Instructions\n\n"
        "{%- if messages[0].role == 'system' %}{{ messages[0].content | replace('/think', '') "
        "| replace('/no_think', '') | trim }}{% else %}You are a helpful AI assistant.{% endif %}"
        "{%- if tools %}\n\n### Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
        "</tools>{% endif %}<|im_end|>\n{%- for message in messages %}{% if message.role != 'system' %}"
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, today.",
            "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATS = {
    "one turn": [{"role": "user", "content": "Hello there. "}],
    "system": [
        {"role": "system", "content": "Answer in French /think"},
        {"role": "user", "content": "What is a prefix cache?"},
    ],
    "turns": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "<think>\nblue is common\n</think>\n\nBlue."},
        {"role": "user", "content": 'Another, with "quotes" and <tags> & ünïcode.'},
    ],
    "out of turn": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family_tokenizers(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    source = ensure_default_model()
    shutil.copyfile(source / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[request.param]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)


def render_both(ours, reference, messages, **options):
    """Each renderer's text, or the exception it raised (type and message)."""
    results = []
    for render in (
        lambda: ours.apply_chat_template(messages, **options),
        lambda: reference.apply_chat_template(messages, tokenize=False, **options),
    ):
        try:
            results.append(render())
        except Exception as error:  # both must refuse alike
            results.append(f"{type(error).__name__}: {error}")
    return results


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_family_template_renders_as_transformers(family_tokenizers, chat, generation_prompt):
    ours, reference = family_tokenizers
    plain = render_both(ours, reference, CHATS[chat], add_generation_prompt=generation_prompt)
    assert plain[0] == plain[1]
    with_tools = render_both(ours, reference, CHATS[chat], add_generation_prompt=generation_prompt, tools=TOOLS)
    assert with_tools[0] == with_tools[1]
    no_thinking = render_both(
        ours, reference, CHATS[chat], add_generation_prompt=generation_prompt, enable_thinking=False
    )
    assert no_thinking[0] == no_thinking[1]


def test_templates_refuse_roles_out_of_turn(family_tokenizers):
    ours, _ = family_tokenizers
    if "raise_exception" not in (ours.chat_template or ""):
        pytest.skip("this family's template accepts any order")
    with pytest.raises(Exception, match="alternate"):
        ours.apply_chat_template(CHATS["out of turn"])
