"""Streamed text for one request: token ids in, text deltas out, stop strings applied.

Two rules make the stream safe to show as it arrives:
- never a partial character: each new token is decoded together with a short window of the tokens
  before it (vLLM's prefix/read offsets), and text is released only when the window's decode grows
  and does not end in U+FFFD (an incomplete UTF-8 sequence, e.g. half an emoji);
- never a stop string: released text is searched for the stop strings (across token boundaries),
  cut at the first match, and any tail that could still grow into a stop string is held back until
  the next token decides it (or `flush()` releases it when the request ends for another reason).

The first output tokens are decoded with the prompt's last few tokens as left context, so tokenizers
that drop a leading space at the start of a decode (SentencePiece) keep it mid-sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.sampling.params import SamplingParams

# Prompt tokens kept as left context for the first output tokens (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DetokenizerDelta:
    text: str                  # new text to stream (possibly empty)
    stopped: bool              # a stop string ended the request
    stop_reason: str | None    # the stop string that matched


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas; `output_text` is everything emitted."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0              # start of the decode window
        self._read_offset = len(self._ids)   # end of what has already been turned into text
        self._num_output_tokens = 0
        self._held = ""                      # decoded text that might still start a stop string
        self._output_text = ""
        self._stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        return self._output_text

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, if any."""
        return self._stop_reason

    @property
    def num_output_tokens(self) -> int:
        """Output tokens read so far (a stop string ends the reading at the token completing it)."""
        return self._num_output_tokens

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> DetokenizerDelta:
        """Add sampled tokens; returns the text that may be streamed now.

        `stop_terminated`: the last token is the eos / a stop token that ends the request; it is not
        turned into text unless `include_stop_str_in_output` (as vLLM), and held text is flushed.
        """
        if self.stopped:
            return DetokenizerDelta("", True, self._stop_reason)
        tokens = list(new_token_ids)
        if stop_terminated and tokens and not self._params.include_stop_str_in_output:
            tokens.pop()
        start = len(self._output_text)
        if not self._params.stop:
            # No stop string to find between tokens: one decode for the whole message (the text
            # is the same; a message ending mid-character waits for the next, as one token would).
            self._ids.extend(tokens)
            self._num_output_tokens += len(tokens)
            self._output_text += self._decode_new_text(final=False)
            tokens = ()
        for token_id in tokens:
            self._ids.append(token_id)
            self._num_output_tokens += 1
            piece = self._decode_new_text(final=False)
            if piece:
                self._output_text += self._release(piece, final=False)
            if self.stopped:
                break
        if stop_terminated and not self.stopped:
            self.flush()
        return DetokenizerDelta(self._output_text[start:], self.stopped, self._stop_reason)

    def flush(self) -> DetokenizerDelta:
        """Release everything held back (the request ended: length, stop token, abort)."""
        if self.stopped:
            return DetokenizerDelta("", True, self._stop_reason)
        text = self._release(self._decode_new_text(final=True), final=True)
        self._output_text += text
        return DetokenizerDelta(text, self.stopped, self._stop_reason)

    def _decode_new_text(self, final: bool) -> str:
        """Text the tokens after `read_offset` add to the window, or "" while it is incomplete."""
        skip = self._params.skip_special_tokens
        window = self._ids[self._prefix_offset:]
        prefix_text = self._tokenizer.decode(window[: self._read_offset - self._prefix_offset], skip)
        full_text = self._tokenizer.decode(window, skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _release(self, piece: str, final: bool) -> str:
        """Apply stop strings to newly decoded text; returns the part that may be emitted."""
        params = self._params
        if not params.stop:
            return piece
        held_before = len(self._held)
        self._held += piece
        if self._num_output_tokens >= params.min_tokens:
            # Search the held text plus the emitted tail a stop string could overlap (only non-empty
            # with include_stop_str_in_output, where nothing is held back).
            tail = self._output_text[-(params.max_stop_str_len - 1):] if params.max_stop_str_len > 1 else ""
            window = tail + self._held
            match = _first_stop(window, params.stop, len(tail) + held_before)
            if match is not None:
                start, stop = match
                cut = start + len(stop) if params.include_stop_str_in_output else start
                self._held = ""
                self._stop_reason = stop
                return window[len(tail):cut] if cut > len(tail) else ""
        keep = 0 if final or params.include_stop_str_in_output else _stop_prefix_len(self._held, params.stop)
        text, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return text


def _first_stop(text: str, stops: Sequence[str], new_from: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends after `new_from` (i.e. in the new text)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    for length in range(longest, 0, -1):
        suffix = text[-length:]
        if any(stop.startswith(suffix) for stop in stops):
            return length
    return 0
