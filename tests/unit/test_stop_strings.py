"""StopStringMatcher (worker/stop_strings.py): vLLM's stop-string rule over a word-level tokenizer whose
words are "w3".."w99" joined by spaces, so every token's text and the overlaps between them are known."""
from __future__ import annotations

import pytest

from engine.errors import InvalidArgument
from engine.tokenizer import Tokenizer
from worker.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS, StopStringMatcher, check_stops

SPECIAL = ("<unk>", "<s>", "</s>")


@pytest.fixture(scope="module")
def words() -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), 100)})
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # "w12 w34"
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    return Tokenizer(backend)


def first_match(tokenizer: Tokenizer, stops: tuple[str, ...], ids: list[int], min_tokens: int = 0,
                skip_special_tokens: bool = True) -> tuple[int | None, str | None]:
    """(index of the token that completed a stop string, which one), or (None, None)."""
    m = StopStringMatcher(stops, tokenizer, skip_special_tokens, min_tokens)
    for k, t in enumerate(ids):
        if m.feed(t):
            return k, m.matched
    return None, None


def test_a_stop_string_ends_at_the_token_that_completes_it(words):
    ids = [12, 34, 56, 78]  # "w12 w34 w56 w78"
    assert first_match(words, ("w56",), ids) == (2, "w56")
    assert first_match(words, ("4 w5",), ids) == (2, "4 w5")  # across two tokens: the second completes it
    assert first_match(words, ("w12 w34 w56",), ids) == (2, "w12 w34 w56")  # longer than the new text
    assert first_match(words, ("w5",), ids) == (2, "w5")  # a prefix of a token's text
    assert first_match(words, ("w9",), ids) == (None, None)
    assert first_match(words, ("w78 ",), ids) == (None, None)  # the text never has the trailing space


def test_the_first_stop_in_the_request_order_wins_within_one_token(words):
    ids = [12, 34]
    assert first_match(words, ("34", "w3"), ids) == (1, "34")
    assert first_match(words, ("w3", "34"), ids) == (1, "w3")
    assert first_match(words, ("w34", "w12"), ids) == (0, "w12")  # earlier token first, whatever the order


def test_no_stop_before_min_tokens_and_old_text_never_matches_later(words):
    ids = [12, 34, 56, 12, 90]
    assert first_match(words, ("w12",), ids) == (0, "w12")
    assert first_match(words, ("w12",), ids, min_tokens=2) == (3, "w12")  # the second w12
    # "w34" appeared at token 1, before min_tokens: it is old text once min_tokens are out.
    assert first_match(words, ("w34",), ids, min_tokens=3) == (None, None)
    assert first_match(words, ("w56",), ids, min_tokens=3) == (2, "w56")  # the third token may stop


def test_special_tokens_count_only_where_they_are_kept(words):
    ids = [12, 2, 34]  # "</s>" is id 2
    assert first_match(words, ("</s>",), ids) == (None, None)
    assert first_match(words, ("</s>",), ids, skip_special_tokens=False) == (1, "</s>")


def test_check_stops(words):
    assert check_stops([], None) == ()
    assert check_stops(["a", "b"], words) == ("a", "b")
    with pytest.raises(InvalidArgument, match="empty string"):
        check_stops(["a", ""], words)
    with pytest.raises(InvalidArgument, match="tokenizer"):
        check_stops(["a"], None)
    assert len(check_stops(["s"] * MAX_STOP_STRINGS, words)) == MAX_STOP_STRINGS
    with pytest.raises(InvalidArgument, match="at most 64 strings"):
        check_stops(["s"] * (MAX_STOP_STRINGS + 1), words)
    with pytest.raises(InvalidArgument, match="1024 characters"):
        check_stops(["x" * (MAX_STOP_CHARS + 1)], words)


def test_multibyte_characters_are_matched_whole(default_model):
    """The real model's byte-level BPE: a character split over tokens only counts once complete."""
    tok = Tokenizer.from_dir(default_model)
    text = "Le café coûte 3€, très cher."
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ("café", "€", "3€,", "très cher"):
        k, matched = first_match(tok, (stop,), ids)
        assert matched == stop
        assert stop in tok.decode(ids[:k + 1]) and stop not in tok.decode(ids[:k])


def reference_match(tokenizer: Tokenizer, stops: tuple[str, ...], ids: list[int], min_tokens: int):
    """vLLM's rule with the whole text decoded afresh after each token (no incremental decoding, no window)."""
    before = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        new = len(text) - len(before)
        if new > 0 and k >= min_tokens:
            for stop in stops:
                if text.find(stop, max(0, len(text) - new - len(stop) + 1)) != -1:
                    return k - 1, stop
        before = text
    return None, None


def test_the_matcher_is_the_rule_on_random_streams(words):
    """Random token streams and stop strings cut from their own text (so that they do match, across tokens and
    inside them): the incremental matcher ends where the rule applied to the whole text ends, with the same
    string."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(3, 99), min_size=1, max_size=12), st.data(), st.integers(0, 4))
    def check(ids, data, min_tokens):
        text = words.decode(ids)
        stops = []
        for _ in range(data.draw(st.integers(1, 3))):
            a = data.draw(st.integers(0, len(text) - 1))
            b = data.draw(st.integers(a + 1, min(len(text), a + 9)))
            stops.append(text[a:b])
        if data.draw(st.booleans()):
            stops.append("w1000")  # never in the text
        stops = tuple(stops)
        assert first_match(words, stops, ids, min_tokens) == reference_match(words, stops, ids, min_tokens)

    check()


def test_streamed_text_stops_before_the_stop_string(words):
    """StopTextBuffer over random streams (the property test's): the pieces sent before the match never hold a
    stop string's first character that the match then cuts; all pieces together are the text up to the matched
    string (or the whole text when none matches)."""
    from hypothesis import given, settings, strategies as st

    from worker.stop_strings import StopTextBuffer

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(3, 99), min_size=1, max_size=12), st.data())
    def check(ids, data):
        text = words.decode(ids)
        a = data.draw(st.integers(0, len(text) - 1))
        stops = (text[a:data.draw(st.integers(a + 1, min(len(text), a + 9)))], "w1000")
        matcher = StopStringMatcher(stops, words, True)
        detok, buffer, sent = words.detokenizer(), StopTextBuffer(stops), []
        for k, t in enumerate(ids):
            piece = detok.step(t)
            if matcher.feed(t):
                sent.append(buffer.stop(piece, matcher.matched))
                full = words.decode(ids[:k + 1])
                assert "".join(sent) == full[:full.index(matcher.matched)]
                return
            sent.append(buffer.push(piece))
        sent.append(buffer.push(detok.flush()) + buffer.flush())
        assert "".join(sent) == text

    check()
