"""The Gemma 4 demo checkpoint's chat template: Gemma 4's prompt format as the instruction-tuned Hub checkpoints'
chat_template.jinja writes it, written from scratch for the parts the demo serves.

- ``<bos>``, then a system turn when there is a system (or developer) message or thinking is on:
  ``<|turn>system\\n`` + ``<|think|>\\n`` (``enable_thinking``) + the system text, trimmed + ``<turn|>\\n``;
- each other message as ``<|turn>{role}\\n`` + its content + ``<turn|>\\n``, the assistant's role spelled ``model``;
  text parts trimmed, a model turn's text without its thinking (``<|channel>`` ... ``<channel|>``), an image part as
  ``<|image|>`` (Gemma4Processor makes it ``<|image>``, the image's soft tokens, ``<image|>``), a video part as
  ``<|video|>``, an audio part as ``<|audio|>``;
- with ``add_generation_prompt``: ``<|turn>model\\n``.

Left out: tools. The Hub template declares them in the system turn in Gemma's own call syntax and folds tool calls and
results into the model's turn; here a tool message, an assistant's tool calls or a tool list is refused (the server
then answers 400). Where the Hub template joins a list-shaped system message's texts with spaces, this one renders it
like any other content.
"""

from __future__ import annotations

CHAT_TEMPLATE = r"""
{%- macro visible(text) -%}
  {#- A model turn's answer without its thinking: what precedes each <|channel> of every <channel|>-ended piece. -#}
  {%- set kept = namespace(text='') -%}
  {%- for piece in text.split('<channel|>') -%}
    {%- set kept.text = kept.text + piece.split('<|channel>')[0] -%}
  {%- endfor -%}
  {{- kept.text | trim -}}
{%- endmacro -%}
{%- macro render(content, role) -%}
  {%- if content is string -%}
    {{- visible(content) if role == 'model' else content | trim -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part['type'] == 'text' -%}
        {{- visible(part['text']) if role == 'model' else part['text'] | trim -}}
      {%- elif part['type'] in ('image', 'image_url') -%}
        {{- '<|image|>' -}}
      {%- elif part['type'] in ('video', 'video_url') -%}
        {{- '<|video|>' -}}
      {%- elif part['type'] in ('audio', 'input_audio') -%}
        {{- '<|audio|>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
  {{- raise_exception('this chat template renders no tools') -}}
{%- endif -%}
{%- set thinking = enable_thinking | default(false) -%}
{%- set has_system = messages and messages[0]['role'] in ('system', 'developer') -%}
{{- bos_token -}}
{%- if thinking or has_system -%}
  {{- '<|turn>system\n' -}}
  {%- if thinking -%}
    {{- '<|think|>\n' -}}
  {%- endif -%}
  {%- if has_system -%}
    {{- render(messages[0]['content'], 'system') -}}
  {%- endif -%}
  {{- '<turn|>\n' -}}
{%- endif -%}
{%- set turns = messages[1:] if has_system else messages -%}
{%- for message in turns -%}
  {%- if message['role'] == 'tool' or message.get('tool_calls') -%}
    {{- raise_exception('this chat template renders no tool calls or results') -}}
  {%- endif -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<|turn>' + role + '\n' + render(message['content'], role) + '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|turn>model\n' -}}
{%- endif -%}
"""
