"""StopChecker: finish reasons, min_tokens, stop strings across tokens, hold-back, flush."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.stop import StopChecker, StopDecision

EOS = 2


def run(
    params: SamplingParams, pieces: list[tuple[int, str]], eos: tuple[int, ...] = (EOS,)
) -> tuple[list[str], StopDecision | None, StopChecker]:
    """Push pieces until a decision; returns the per-step emitted text."""
    checker = StopChecker(params, eos)
    emitted: list[str] = []
    decision = None
    for n, (tok, text) in enumerate(pieces, start=1):
        out, decision = checker.push(tok, text, n)
        emitted.append(out)
        if decision is not None:
            break
    return emitted, decision, checker


def test_no_stop_conditions_passes_text_through() -> None:
    emitted, decision, _ = run(SamplingParams(max_tokens=10), [(5, "ab"), (6, "cd")])
    assert emitted == ["ab", "cd"] and decision is None


def test_length() -> None:
    emitted, decision, _ = run(SamplingParams(max_tokens=2), [(5, "a"), (6, "b"), (7, "c")])
    assert emitted == ["a", "b"]
    assert decision == StopDecision("length", None)


def test_eos_stops_and_its_text_is_dropped() -> None:
    emitted, decision, _ = run(SamplingParams(), [(5, "a"), (EOS, "</s>"), (6, "x")])
    assert emitted == ["a", ""]
    assert decision == StopDecision("stop", None)


def test_eos_text_kept_with_include_stop_str() -> None:
    p = SamplingParams(include_stop_str_in_output=True)
    emitted, _, _ = run(p, [(5, "a"), (EOS, "</s>")])
    assert emitted == ["a", "</s>"]


def test_ignore_eos_does_not_stop() -> None:
    p = SamplingParams(ignore_eos=True, max_tokens=3)
    emitted, decision, _ = run(p, [(EOS, "x"), (EOS, "y"), (EOS, "z")])
    assert emitted == ["x", "y", "z"]
    assert decision == StopDecision("length")


def test_stop_token_id_reports_the_id_even_with_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=[9, EOS], ignore_eos=True)
    _, decision, _ = run(p, [(5, "a"), (9, "!")])
    assert decision == StopDecision("stop", 9)
    _, decision, _ = run(p, [(EOS, "")])
    assert decision == StopDecision("stop", EOS)


def test_multiple_eos_ids() -> None:
    _, decision, _ = run(SamplingParams(), [(5, "a"), (7, "")], eos=(EOS, 7))
    assert decision == StopDecision("stop", None)


def test_stop_beats_length_on_the_last_token() -> None:
    _, decision, _ = run(SamplingParams(max_tokens=2), [(5, "a"), (EOS, "")])
    assert decision == StopDecision("stop", None)
    _, decision, _ = run(SamplingParams(max_tokens=2, stop=["b"]), [(5, "a"), (6, "b")])
    assert decision == StopDecision("stop", "b")


def test_min_tokens_suppresses_every_stop_kind() -> None:
    p = SamplingParams(min_tokens=3, max_tokens=10, stop=["x"], stop_token_ids=[9])
    emitted, decision, _ = run(p, [(EOS, "e"), (9, "n"), (5, "x"), (EOS, "E")])
    # Tokens 1..3 cannot stop and their text passes through unheld; token 4 (EOS) stops.
    assert emitted == ["e", "n", "x", ""]
    assert decision == StopDecision("stop", None)


def test_stop_string_only_matches_text_after_min_tokens() -> None:
    p = SamplingParams(min_tokens=1, stop=["ab"])
    emitted, decision, _ = run(p, [(5, "a"), (6, "b"), (7, "ab"), (8, "z")])
    assert emitted == ["a", "b", ""]
    assert decision == StopDecision("stop", "ab")


def test_stop_string_within_one_token() -> None:
    emitted, decision, _ = run(SamplingParams(stop=["STOP"]), [(5, "hi"), (6, " xSTOPyz")])
    assert emitted == ["hi", " x"]
    assert decision == StopDecision("stop", "STOP")


def test_stop_string_spanning_tokens_is_held_back_then_cut() -> None:
    emitted, decision, _ = run(SamplingParams(stop=["END"]), [(5, "abE"), (6, "N"), (7, "Dq")])
    assert emitted == ["ab", "", ""]
    assert decision == StopDecision("stop", "END")


def test_include_stop_str_in_output() -> None:
    p = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    emitted, _, _ = run(p, [(5, "abE"), (6, "N"), (7, "Dq")])
    assert "".join(emitted) == "abEND"


def test_false_start_is_released() -> None:
    emitted, decision, _ = run(SamplingParams(stop=["END"]), [(5, "aE"), (6, "Nx"), (7, "y")])
    assert emitted == ["a", "ENx", "y"] and decision is None


def test_hold_back_is_minimal() -> None:
    # Only a suffix that could still start a stop string is held back.
    checker = StopChecker(SamplingParams(stop=["abc", "zz"]), [EOS])
    assert checker.push(5, "xya", 1) == ("xy", None)
    assert checker.push(6, "q", 2) == ("aq", None)
    assert checker.push(7, "z", 3) == ("", None)
    assert checker.flush() == "z"
    assert checker.flush() == ""


def test_flush_returns_tail_when_ending_for_another_reason() -> None:
    checker = StopChecker(SamplingParams(stop=["<|im_end|>"]), [EOS])
    assert checker.push(5, "hello <|im", 1) == ("hello ", None)
    assert checker.flush() == "<|im"


def test_length_emits_held_tail() -> None:
    p = SamplingParams(max_tokens=2, stop=["END"])
    emitted, decision, _ = run(p, [(5, "aE"), (6, "N")])
    assert emitted == ["a", "EN"]
    assert decision == StopDecision("length")


def test_eos_emits_held_tail_but_not_eos_text() -> None:
    emitted, _, _ = run(SamplingParams(stop=["END"]), [(5, "aEN"), (EOS, "</s>")])
    assert emitted == ["a", "EN"]


def test_earliest_stop_string_wins_longest_on_tie() -> None:
    _, decision, _ = run(SamplingParams(stop=["cd", "b"]), [(5, "abcd")])
    assert decision == StopDecision("stop", "b")
    p = SamplingParams(stop=["ab", "abc"], include_stop_str_in_output=True)
    emitted, decision, _ = run(p, [(5, "xabcd")])
    assert emitted == ["xabc"] and decision == StopDecision("stop", "abc")


def test_push_after_stop_raises_and_bad_count() -> None:
    checker = StopChecker(SamplingParams(), [EOS])
    checker.push(EOS, "", 1)
    assert checker.decision == StopDecision("stop")
    with pytest.raises(RuntimeError):
        checker.push(5, "a", 2)
    with pytest.raises(ValueError, match="num_output_tokens"):
        StopChecker(SamplingParams(), [EOS]).push(5, "a", 0)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abE", max_size=30),
    stops=st.lists(st.text(alphabet="abE", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_stream_equals_one_shot_truncation(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    """However the text is split into tokens, the stream equals the reference: cut at
    the first token whose text completes a stop string (earliest start, longest on a
    tie); and nothing emitted early is ever cut later."""
    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    p = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=100)
    checker = StopChecker(p, [EOS])

    expected, hit = text, None
    for end in bounds[1:]:
        hits = [(text.find(s, 0, end), -len(s), s) for s in stops if s in text[:end]]
        if hits:
            at, _, hit = min(hits)
            expected = text[: at + len(hit)] if include else text[:at]
            break

    out = ""
    decision = None
    for n, piece in enumerate(pieces, start=1):
        emitted, decision = checker.push(5, piece, n)
        out += emitted
        assert expected.startswith(out)  # nothing emitted early that gets cut later
        if decision is not None:
            break
    if decision is None:
        out += checker.flush()
    assert out == expected
    assert decision == (StopDecision("stop", hit) if hit is not None else None)
