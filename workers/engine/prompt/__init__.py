"""From a rendered prompt and media to model inputs: the multimodal processor (image placeholders, grids, hashes
as pad values), pixel frames in shared memory, video probing, decoding and prompts. Used by the tokenizer process
and the offline engine; imports ``models`` for the family interface."""
