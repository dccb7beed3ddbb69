"""String stops (vLLM's SamplingParams.stop) for the gateway's Generate: a choice ends at the first output
token whose text completes one of the strings.

The match is vLLM's (StopChecker.check_stop_strings): the output text is the detokenized output tokens (the
request's skip_special_tokens); after each token that adds characters, each stop string in the request's
order is looked for where it would overlap those new characters, and the first one found ends the choice,
with that token as its last. No string matches before min_tokens output tokens (vLLM checks min_tokens
first). The text itself stays the gateway's: smg detokenizes the token ids it receives and trims the stop
string (or keeps it, include_stop_str_in_output) itself, so only the token ids and the matched string
(GenerateComplete.matched_stop_str) go back.

It runs on the event loop over each choice's tokens as they stream, off the engine's step path, as vLLM v1
matches stop strings in its front end: the steps already launched behind the matching one are discarded
when the choice's sequence is stopped.
"""
from __future__ import annotations

from engine.errors import InvalidArgument
from engine.tokenizer import Tokenizer


# Each token of a stream with stop strings looks for every one of them near its new text: bounded, so that one
# request cannot make every token of its stream cost milliseconds (OpenAI's API takes 4 stop strings).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def check_stops(stops: list[str], tokenizer: Tokenizer | None, field: str = "sampling_params.stop") -> tuple[str, ...]:
    """The request's stop strings (its field named `field` in the messages), checked: none empty (vLLM refuses an
    empty one), within the limits, and a tokenizer to match them with."""
    if not stops:
        return ()
    if any(not s for s in stops):
        raise InvalidArgument(f"{field} cannot contain an empty string")
    if len(stops) > MAX_STOP_STRINGS or max(map(len, stops)) > MAX_STOP_CHARS:
        raise InvalidArgument(f"{field} takes at most {MAX_STOP_STRINGS} strings of at most "
                              f"{MAX_STOP_CHARS} characters each, got {len(stops)} of up to {max(map(len, stops))}")
    if tokenizer is None:
        raise InvalidArgument(f"{field} needs the checkpoint's tokenizer (tokenizer.json), which this "
                              "worker's checkpoint lacks; send stop_token_ids instead")
    return tuple(stops)


class StopStringMatcher:
    """One choice's output tokens -> whether a stop string has appeared in its text."""

    def __init__(self, stops: tuple[str, ...], tokenizer: Tokenizer, skip_special_tokens: bool, min_tokens: int = 0):
        self.stops = stops
        self.min_tokens = min_tokens
        self.matched: str | None = None  # the stop string that ended the choice
        self._detokenizer = tokenizer.detokenizer(skip_special_tokens)
        self._longest = max(len(s) for s in stops)
        self._tail = ""  # the text's last (longest stop - 1) characters: all a match can overlap besides new text
        self._tokens = 0

    def feed(self, token_id: int) -> bool:
        """Takes the next output token; True when its text completes a stop string (self.matched says which)."""
        self._tokens += 1
        new = self._detokenizer.step(token_id)
        if not new:
            return False
        window = self._tail + new
        self._tail = window[max(0, len(window) - (self._longest - 1)):]
        if self._tokens < self.min_tokens:
            return False
        for stop in self.stops:
            # A match must end inside the new characters: it starts at most len(stop) - 1 characters before them.
            if window.find(stop, max(0, len(window) - len(new) - len(stop) + 1)) != -1:
                self.matched = stop
                return True
        return False


class StopTextBuffer:
    """The streamed text of a stream with stop strings, as vLLM streams it: the last (longest stop - 1) characters
    are held back, since a stop string may begin there; once a stop string ends the stream, the text stops just
    before it (the string itself is not sent)."""

    def __init__(self, stops: tuple[str, ...]):
        self._hold = max(len(s) for s in stops) - 1
        self._sent = 0  # characters of the text sent so far
        self._text = ""  # the text so far: sent, then held back

    def push(self, piece: str) -> str:
        """A token's text piece in; what may be sent now."""
        self._text += piece
        upto = max(self._sent, len(self._text) - self._hold)
        out, self._sent = self._text[self._sent:upto], upto
        return out

    def stop(self, piece: str, stop: str) -> str:
        """The last token's piece, whose text completed `stop` (overlapping the piece's characters): what is left
        to send, up to the string's start."""
        self._text += piece
        start = self._text.find(stop, max(0, len(self._text) - len(piece) - len(stop) + 1))
        out = self._text[self._sent:max(start, self._sent)]
        self._sent = len(self._text)
        return out

    def flush(self) -> str:
        """The stream ended otherwise: everything held back."""
        out, self._sent = self._text[self._sent:], len(self._text)
        return out
