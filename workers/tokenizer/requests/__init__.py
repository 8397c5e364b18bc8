"""Request bodies: the chat and completions requests, their sampling fields and structured-output checks,
each turned into a prompt and ``SamplingParams`` or refused with a ``BadRequest`` naming the field."""
