"""Model directories for end-to-end tool-calling tests: the tiny preset's random weights and
byte-level tokenizer, with a real model family's tool-capable chat template and, where the
family has them, tool markers as special tokens (`[TOOL_CALLS]`, `<|python_tag|>`), the
vocabulary and the weights grown to hold them.

The templates follow each family's published format (what matters: where tools go in the
prompt, how assistant `tool_calls` and `tool` results are rendered, the generation prompt).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.presets import resolve_model_dir

SPECIAL_TOKENS = ("[TOOL_CALLS]", "<|python_tag|>")

# Qwen2.5 (hermes): tools in the system turn, calls as <tool_call> blocks, results as a user turn.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3.1 JSON tool calling: tools in the first user turn, a call is the whole reply.
LLAMA31 = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral v0.3: tools before the last user turn, calls after the [TOOL_CALLS] control token,
# 9-character call ids (the template refuses others).
MISTRAL = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {{- tool | tojson }}
                {%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.id is not string or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- '{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments|tojson + ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {%- if message.tool_call_id is not string or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|tojson + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user, assistant and tool roles are supported") }}
    {%- endif %}
{%- endfor %}
"""

# DeepSeek-R1: the generation prompt opens the thinking.
DEEPSEEK_R1 = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}{{- '<｜Assistant｜>' + (message.content or '') + '<｜end▁of▁sentence｜>' }}
    {%- else %}{{- message.content }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\n' }}{%- endif %}
"""


def pod_model_dir(root: Path) -> Path:
    """The tiny preset with `SPECIAL_TOKENS` added to its vocabulary (embedding and head rows
    appended, drawn from a fixed seed), for the pods and the routers alike."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    out = root / "tiny-tools"
    if (out / "model.safetensors").is_file():
        return out
    src = resolve_model_dir("tiny")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, out / name)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    config = json.loads((src / "config.json").read_text())
    old_vocab, config["vocab_size"] = config["vocab_size"], vocab
    config.pop("cbserve_preset", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = torch.randn((vocab - old_vocab, weights[name].shape[1]), generator=gen) * weights[name].std()
        weights[name] = torch.cat([weights[name], extra])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def router_model_dir(root: Path, pod_dir: Path, name: str, template: str) -> Path:
    """A directory with the pods' tokenizer and config and another chat template (the router
    renders prompts; the pods never read the template)."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    for file in ("tokenizer.json", "special_tokens_map.json", "config.json"):
        shutil.copy(pod_dir / file, out / file)
    config = json.loads((pod_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
