"""The pass-key prompts pykvq calibrate builds over its text (pykvq.calibration.retrieval)."""

from __future__ import annotations

import pytest

from pykvq.calibration.retrieval import NEEDLE, QUESTION, RetrievalProbe

PREFIX = [1]


def tokenize(text: str, add_special: bool) -> list[int]:
    return (PREFIX if add_special else []) + [ord(c) for c in text]


def test_each_prompt_is_text_then_its_number_and_the_question() -> None:
    body = list(range(1000, 1600))
    probe = RetrievalProbe(n_tokens=300, n_keys=3, seed=7)
    keys = probe.keys()
    assert keys == RetrievalProbe(300, 3, seed=7).keys() and len(set(keys)) == 3
    assert all(len(k) == 5 and k.isdigit() for k in keys)
    prompts = probe.prompts(PREFIX + body, tokenize, window=32)
    fillers = []
    for prompt, key in zip(prompts, keys, strict=True):
        tail = tokenize(NEEDLE.format(key=key) + QUESTION, False)
        assert len(prompt) == 300 and prompt[:1] == PREFIX and prompt[-len(tail):] == tail
        fillers.append(prompt[1:-len(tail)])
    # the stretches spread over the text: its start, its middle, its end
    assert fillers[0][0] == body[0] and fillers[-1][-1] == body[-1]
    assert fillers[0][0] < fillers[1][0] < fillers[2][0]
    assert all(f == body[f[0] - 1000:f[0] - 1000 + len(f)] for f in fillers)


def test_a_text_or_length_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="the calibration text has 101 tokens"):
        RetrievalProbe(300, 2).prompts(PREFIX + list(range(100)), tokenize, window=32)
    with pytest.raises(ValueError, match="need more than the 128-token fp16 window"):
        RetrievalProbe(160, 2).prompts(PREFIX + list(range(1000)), tokenize, window=128)
