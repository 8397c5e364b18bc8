"""How long each chunk of a step is: the token budget, what the tokenizer has written, the image cap of steps that
carry decodes (``decode_step_image_tokens``: the images a chunk would send through the vision encoder) and what
those encodes cost of the budget (``encode_token_cost``), the encoder
workers' landed images, a hybrid model's 64-token chunk grid, and images whose tokens attend both ways. Bookkeeping
only; ``SchedulerCore`` (scheduler.py) picks the sequences and builds the plan."""

from __future__ import annotations

import math

from ipc.prompts import MMItem
from workers.engine.core.bookkeeping import SequenceBook
from workers.engine.core.sequence import Sequence

# An image that costs more than the step's budget goes in a step whose other prefill chunks total at most this share of
# the budget: a prompt's last few tokens (a 1080p image's prompt at a 2,048 budget leaves ~50) then ride with the next
# image's encode instead of taking a step of their own, which cost (b) a step per request (H200 Qwen3-VL-8B trace:
# 323 steps against 196 without the rule; SchedulerCore on that load plans 317 -> 255).
SMALL_PREFILL_SHARE = 16


class ChunkSizing(SequenceBook):
    """The chunk-length rules of ``SchedulerCore``, over the state ``SequenceBook`` keeps (the step's image-cap
    counters ``_encode_left`` and ``_encoding`` are set by ``schedule`` for each plan)."""

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` this step computes: up to the budget and what is computable, on a hybrid model ending at
        a multiple of ``chunk_align`` inside the prompt where it can, and, where image tokens
        attend both ways (``whole_images``), never ending inside an image's span. Such a span is cut before it
        when the chunk has tokens before it; a chunk that starts inside or at it takes the rest of the span whole,
        past the budget if need be (at most one image's tokens, 1,120 on Gemma 4), since no token of it could be
        computed without its later tokens' keys."""
        start, computable = seq.num_scheduled, seq.computable()
        length = self._cap_encodes(seq, start, min(computable - start, budget), budget)
        if self.remote is not None and length > 0:  # never past an image the encoder workers have not landed yet
            length = self.remote.stop_at(seq, start, length)
        if self.chunk_align > 1 and length > 0 and start + length < seq.prompt_len:
            length = self._on_grid(seq, start, length, budget)
        if not self.whole_images or length <= 0:
            return length
        end = start + length
        for item in seq.items:
            span_end = item.offset + item.length
            if not item.offset < end < span_end:
                continue
            if item.offset > start:
                return item.offset - start
            return span_end - start if span_end <= computable else 0
        return length

    def _on_grid(self, seq: Sequence, start: int, length: int, budget: int) -> int:
        """A hybrid model's chunk that ends inside the prompt, cut back to a multiple of ``chunk_align``
        (state_cache.CHUNK_ALIGN), so the next one starts there. A sequence on that grid whose chunk cannot reach
        its next point waits instead (0) where waiting ends by itself: a step's leftover budget (steps are at least
        4 grid cells, SequenceBook), or a text-only piece cut short by an image that other chunks' encodes or the
        tokenizer hold back (a piece with an image of its own may be cut by that image's cost against the cap, which
        waiting would not change). Otherwise the piece is taken (nothing stalls), and only its own and the next
        chunk's snapshots fall off the kernels' grid."""
        aligned = (start + length) // self.chunk_align * self.chunk_align
        if aligned > start:
            return aligned - start
        if start % self.chunk_align:
            return length
        text_only = not any(it.offset < start + length and it.offset + it.length > start for it in seq.items)
        return 0 if length == budget or text_only else length

    def _uncached_images(self, seq: Sequence, start: int, end: int) -> list[MMItem]:
        """The images [start, end) of ``seq`` reaches that this step would encode: in neither tier of the embedding
        cache and not already encoded by an earlier chunk of the step, in prompt order."""
        index = self.mm_index
        return [it for it in sorted(seq.items, key=lambda it: it.offset)
                if it.offset < end and it.offset + it.length > start
                and it.hash not in self._encoding and it.hash not in index and it.hash not in index.host]

    def _cap_encodes(self, seq: Sequence, start: int, length: int, budget: int) -> int:
        """``length`` cut so that the step's encodes stay within ``decode_step_image_tokens``, and with
        ``encode_token_cost`` within the step's token budget (a step with decodes; neither applies otherwise): each
        image the chunk would encode costs ``ceil(cost * its tokens)`` of ``budget``. The chunk ends before the first
        image past the cap, or whose cost leaves no token of it inside the budget. A step that encodes nothing yet
        still takes one image past the cap, and one past the budget if the step's other prefill chunks are small
        (``SMALL_PREFILL_SHARE``; so a large image goes alone but for a prompt's tail, its chunk reaching at least its
        first token, and never on top of another sequence's full chunk). 0 when the chunk starts at such an image:
        the sequence waits a step."""
        left, cost = self._encode_left, self._encode_cost
        if (left is None and not cost) or length <= 0:
            return length
        spent = reach = 0  # budget this chunk's encodes cost; tokens the chunk needs to reach each image it encodes
        small_prefill = self._prefill_tokens <= self.chunk_size // SMALL_PREFILL_SHARE
        for item in self._uncached_images(seq, start, start + length):
            before = max(0, item.offset - start)
            alone = not self._encoding and not reach  # the step encodes nothing yet
            price = math.ceil(cost * item.length)
            over_cap = left is not None and item.length > left
            over_budget = before + spent + price >= budget
            if (over_cap and not alone) or (over_budget and not (alone and small_prefill)):
                length = before
                break
            spent += price
            reach = before + 1
            if left is not None:
                left -= item.length
        return min(length, max(budget - spent, reach))

    def _charge_encodes(self, seq: Sequence, start: int, length: int) -> int:
        """Count the images a picked chunk makes this step encode against the step's cap; returns what they cost
        of the step's token budget (``encode_token_cost``)."""
        if self._encode_left is None and not self._encode_cost:
            return 0
        price = 0
        for item in self._uncached_images(seq, start, start + length):
            self._encoding.add(item.hash)
            price += math.ceil(self._encode_cost * item.length)
            if self._encode_left is not None:
                self._encode_left -= item.length
        return price
