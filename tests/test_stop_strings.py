"""Stop strings (retrograd.serving.inference.StopStrings): the reply is cut before the first stop
string, whatever pieces the text arrives in, and checking a piece costs time linear in the
piece, not in the stops' length (`serve` runs it while every other request waits)."""

from __future__ import annotations

import random

from retrograd.serving.inference import StopStrings


def naive(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    """What each piece lets out, by brute force: after each piece, cut before the earliest
    stop string in the stream; otherwise hold back the longest tail that begins a stop."""
    stream, sent, out = "", 0, []
    for piece in pieces:
        stream += piece
        hits = [stream.find(s) for s in stops if s and s in stream]
        if hits:
            return [*out, stream[sent : min(hits)]], True
        hold = max((k for s in stops for k in range(1, len(s)) if stream.endswith(s[:k])), default=0)
        out.append(stream[sent : len(stream) - hold])
        sent = len(stream) - hold
    return [*out, stream[sent:]], False


def streamed(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    cutter, out = StopStrings(stops), []
    for piece in pieces:
        text, stopped = cutter.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    return [*out, cutter.flush()], False


def test_a_stop_split_across_pieces_is_cut_and_a_false_start_is_let_out():
    assert streamed(["The capital is Pa", "r", "is, of course"], ("Paris",)) == (["The capital is ", "", ""], True)
    assert streamed(["Pa", "ge 2"], ("Paris",)) == (["", "Page 2", ""], False)
    assert streamed(["ab", "cd"], ("abcd", "bc")) == (["", ""], True)  # both end in one piece: the first to begin
    assert streamed(["abc", "d"], ("abcd", "bc")) == (["a"], True)  # "bc" ended first


def test_every_split_of_random_streams_matches_brute_force():
    rng = random.Random(22)
    for _ in range(3000):
        stops = tuple("".join(rng.choices("ab", k=rng.randint(0, 5))) for _ in range(rng.randint(1, 4)))
        text = "".join(rng.choices("abc", k=rng.randint(0, 30)))
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(pieces, stops) == naive(pieces, stops), (pieces, stops)


class CountedStr(str):
    """A stop string that counts how often it is read (indexed or sliced)."""

    reads = 0

    def __getitem__(self, key):
        CountedStr.reads += 1
        return super().__getitem__(key)


def test_a_long_stop_costs_linear_work_not_its_length_per_piece():
    stop = CountedStr("a" * 4999 + "b")
    cutter, CountedStr.reads = StopStrings((stop,)), 0
    for _ in range(200):
        assert cutter.feed("a") == ("", False)  # each "a" might still begin the stop
    # linear: a few reads per stop character (set-up) and per character fed; checking each
    # piece against every prefix of the stop read it 5,000 times a piece, 1,000,000 in all
    assert CountedStr.reads <= 4 * (len(stop) + 200)
    assert cutter.feed("b") == ("a" * 200 + "b", False)
