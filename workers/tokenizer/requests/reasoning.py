"""What a chat request's answer continues, for the reasoning split (``--reasoning-parser``)."""

from __future__ import annotations

from workers.tokenizer.requests.chat import ChatCompletionRequest, TextPart


def continued_text(chat: ChatCompletionRequest, prompt_text: str) -> str | None:
    """With ``continue_final_message``: the assistant message's text the prompt ends with (its last text part), so
    the split starts inside the reasoning when that text opened it (``<think>`` and no ``</think>`` after). None
    without it, or when the template rewrote the message (the prompt does not end with its text): then the prompt's
    end alone decides, as for a generation prompt."""
    if not chat.continue_final_message:
        return None
    content = chat.messages[-1].content
    if isinstance(content, str):
        text = content
    else:
        texts = [p.text for p in content or [] if isinstance(p, TextPart)]
        text = texts[-1] if texts else ""
    # Templates trim a message's text; transformers ends the prompt right after what the template wrote of it.
    return text if text.strip() and prompt_text.rstrip().endswith(text.strip()) else None
