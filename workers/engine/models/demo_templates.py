"""The pieces of Qwen's prompt format (written from scratch) that every demo checkpoint's chat template shares; each
family's demo.py puts them together with what differs (a default system turn or none, how a video part is spelled,
where an assistant's tool calls go).

Every piece keeps its place's indentation, since the template's text is what chat_template.jinja holds, and every
literal newline is emitted by an expression so the ``-`` whitespace control can keep the template readable.
"""

from __future__ import annotations


def render_macro(video: str) -> str:
    """``render(content)``: a message's text, each image part as its vision_start/pad/end triple and each video part
    as ``video`` (the family's processor decides what a video placeholder expands to)."""
    return r"""
{%- macro render(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part['type'] in ('image', 'image_url', 'input_image') -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif part['type'] in ('video', 'video_url') -%}
        {{- '""" + video + r"""' -}}
      {%- elif part['type'] == 'text' -%}
        {{- part['text'] -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0]['role'] == 'system' -%}
"""


# Inside the system turn, after the "# Tools" heading: one JSON schema per line inside <tools>, then how to call them.
TOOL_SCHEMAS = r"""
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
  {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' -}}
  {{- '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
"""

# Opens the message loop: consecutive `tool` messages are folded into one user turn of <tool_response> blocks.
MESSAGES_AND_TOOL_RESPONSES = r"""
{%- for message in messages -%}
  {%- set role = message['role'] -%}
  {%- if role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + render(message['content']) + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
"""

# Closes the message loop and opens the assistant's turn when asked to. ``enable_thinking`` as the thinking Qwen
# checkpoints' templates read it, when a request sets it: true opens the reasoning (the answer starts inside it, as
# Qwen3.5's does by default), false writes an empty one; left unset the demo's prompts stay as they were.
GENERATION_PROMPT = r"""
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking -%}
    {{- '<think>\n' -}}
  {%- elif enable_thinking is defined -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
"""


def qwen_chat_template(video: str, tools_system: str, plain_system: str, turns: str) -> str:
    """A chat template in Qwen's format from the parts where the families differ: ``video``, what a video part
    renders as; ``tools_system``, the system turn's opening up to its "# Tools" heading (inside ``{%- if tools -%}``);
    ``plain_system``, the system turn without tools (the ``elif`` branches and the closing ``endif``); ``turns``, the
    message loop's branches after the one for `tool` messages."""
    pieces = (render_macro(video), tools_system, TOOL_SCHEMAS, plain_system, MESSAGES_AND_TOOL_RESPONSES, turns)
    # joined without the blank lines their triple-quoted spelling leaves at each end
    return "\n".join(piece.strip("\n") for piece in (*pieces, GENERATION_PROMPT))
