"""Text out of token ids: the byte-level tokenizer's incremental decoding never splits a
character, and stop sequences cut the text before them even when they arrive over several
steps, with nothing of them ever released."""

from __future__ import annotations

from hypothesis import given, strategies as st

from slicesched.server.service import Output
from slicesched.server.tokenizer import ByteTokenizer, template_chat


def _out(stops):
    return Output(ByteTokenizer().stream(), stops)


def test_a_character_split_over_steps_comes_out_whole():
    ids = list("né✓".encode())
    s = ByteTokenizer().stream()
    pieces = [s.add([i]) for i in ids] + [s.end()]
    assert "".join(pieces) == "né✓" and "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # held until its second byte


def test_output_ids_beyond_a_byte_stand_for_their_byte():
    s = ByteTokenizer().stream()
    assert s.add([256 + ord("h"), 512 + ord("i")]) + s.end() == "hi"


def test_a_stop_sequence_arriving_over_steps_cuts_the_text_before_it():
    out = _out(["END"])
    released = [out.add(tuple(b"abcE")), out.add(tuple(b"N")), out.add(tuple(b"Dxyz"))]
    assert "".join(released) == "abc" and out.stopped and out.text == "abc"


def test_text_that_cannot_start_a_stop_sequence_is_released_at_once():
    out = _out(["STOP"])
    assert out.add(tuple(b"hello")) == "he"  # the last three letters could be the start of "STOP"
    assert out.end() == "llo" and not out.stopped


@given(st.text(alphabet="abcS", max_size=30), st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_released_text_is_the_text_up_to_the_first_stop_however_it_is_split(text, cuts):
    stops = ["Sa", "bcS"]
    data, out, got, i = text.encode(), _out(stops), [], 0
    for n in cuts * 10:
        if i >= len(data) or out.stopped:
            break
        got.append(out.add(tuple(data[i:i + n])))
        i += n
    if not out.stopped:
        got.append(out.add(tuple(data[i:])))
        got.append(out.end())
    first = min([text.find(s) for s in stops if s in text], default=len(text))
    assert "".join(got) == text[:first]


def test_chat_messages_without_a_template_use_the_documented_format():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert template_chat(msgs) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert ByteTokenizer().chat(msgs) == list(template_chat(msgs).encode())
