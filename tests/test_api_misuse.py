"""The Python API refuses what llama.cpp would crash on or silently take: a closed model or context, a context on a
model without weights, token ids outside the vocabulary, out-of-range context and sampling settings; a failed
evaluation leaves the cache as it was, or says what it could not take back."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import pykvq.api.llama as api
from pykvq import ContextConfig, KvConfig, LlamaError, Model, SamplerSettings

import device

KIVI2 = KvConfig.preset("kivi2")


def test_closing_a_model_closes_its_contexts(smollm2: Path) -> None:
    with device.load_model(smollm2) as model:
        ctx = model.context(device.context_config(n_ctx=256, kv=KIVI2))
        other = model.context(device.context_config(n_ctx=256))
        other.close()
    assert model.closed and ctx.closed
    ctx.close()  # closing again is no error
    for use in (lambda: ctx.eval([1, 2, 3]), ctx.save_state, ctx.memory, lambda: ctx.seq_len(0)):
        with pytest.raises(LlamaError, match=r"the context is closed \(closing its model closes it too\)"):
            use()
    with pytest.raises(LlamaError, match=r"the context is closed"):
        other.eval([1])
    for use in (lambda: model.tokenize("hi"), lambda: model.token_to_piece(1), lambda: model.n_vocab,
                lambda: model.context(device.context_config(n_ctx=256))):
        with pytest.raises(LlamaError, match=r"the model is closed: load it again"):
            use()


@pytest.mark.parametrize("flag", ["vocab_only", "metadata_only"])
def test_a_model_without_weights_makes_no_context(smollm2: Path, flag: str) -> None:
    with Model(smollm2, **{flag: True}) as model:
        assert model.tokenize("hi")
        with pytest.raises(LlamaError, match=f"was loaded with {flag}=True, without weights"):
            model.context(device.context_config(n_ctx=256))


def test_token_ids_outside_the_vocabulary_are_refused(model: Model) -> None:
    n_vocab = model.n_vocab
    for use, token in ((lambda: model.token_to_piece(n_vocab + 5), n_vocab + 5),
                       (lambda: model.token_to_piece(-3), -3),
                       (lambda: model.detokenize([1, n_vocab]), n_vocab)):
        with pytest.raises(ValueError, match=f"token id {token} is not in the vocabulary .* {n_vocab} tokens"):
            use()


def test_a_bad_token_id_adds_nothing(model: Model) -> None:
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * 20)
    with model.context(device.context_config(n_ctx=512, n_batch=64, n_ubatch=64, kv=KIVI2, n_seq_max=2)) as ctx:
        ctx.eval(tokens[:10])
        # the bad id sits in the third batch of 64: the first two would be decoded, and a kivi cache could not
        # take them back
        with pytest.raises(ValueError, match=f"token id {model.n_vocab} is not in the vocabulary"):
            ctx.eval(tokens[10:160] + [model.n_vocab])
        with pytest.raises(ValueError, match="token id -1 is not in the vocabulary"):
            ctx.eval_seqs({1: tokens[:20], 0: tokens[10:150] + [-1]})
        assert ctx.n_past == ctx.seq_len(0) == 10 and ctx.seq_len(1) == 0


@pytest.mark.parametrize("kv, n_past, message", [
    (KvConfig(), 10, r"llama_decode failed with status -1$"),
    (KIVI2, 138, r"llama_decode failed with status -1; the tokens decoded before the failure could not be removed "
                 r"again \(.*cannot remove tokens \[10, -1\) of 138.*\): sequence 0 keeps 128 of them \(138 tokens "
                 r"in all\)$"),
])
def test_a_decode_failing_halfway_says_what_the_cache_kept(model: Model, monkeypatch: pytest.MonkeyPatch,
                                                           kv: KvConfig, n_past: int, message: str) -> None:
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * 20)[:160]
    with model.context(device.context_config(n_ctx=512, n_batch=64, n_ubatch=64, kv=kv)) as ctx:
        ctx.eval(tokens[:10])
        decodes = 0
        real_call = api._call

        def third_decode_fails(function, *args):
            # a failure llama.cpp could report for any batch (out of memory, a backend error), before it decodes
            nonlocal decodes
            if function is ctx._lib.llama.llama_decode:
                decodes += 1
                if decodes == 3:
                    return -1
            return real_call(function, *args)

        monkeypatch.setattr(api, "_call", third_decode_fails)
        with pytest.raises(LlamaError, match=message):
            ctx.eval(tokens[10:])
        assert ctx.n_past == ctx.seq_len(0) == n_past


@pytest.mark.parametrize("setting, message", [
    ({"n_batch": -5}, "-b/n_batch must be 1 or more, got -5"),
    ({"n_ubatch": 0}, "-ub/n_ubatch must be 1 or more, got 0"),
    ({"n_ctx": -1}, r"-c/n_ctx must be 0 or more \(0: the model's training context\), got -1"),
    ({"n_ctx": 2**31}, "-c/n_ctx must be at most 2147483647, got 2147483648"),
    ({"n_seq_max": 0}, "-np/n_seq_max must be 1 or more, got 0"),
    ({"n_threads": 0}, "-t/n_threads must be 1 or more, got 0"),
    ({"n_threads": -2}, "-t/n_threads must be 1 or more, got -2"),
])
def test_context_settings_out_of_range_are_refused(setting: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        ContextConfig(**setting)


def test_n_ctx_0_is_the_training_context(model: Model) -> None:
    with model.context(device.context_config(n_ctx=0, n_batch=64, n_ubatch=64)) as ctx:
        assert ctx.n_ctx == model.n_ctx_train


@pytest.mark.parametrize("setting", [{"temp": math.nan}, {"temp": math.inf}, {"temp": -math.inf},
                                     {"top_p": math.nan}, {"min_p": math.inf}])
def test_non_finite_sampling_settings_are_refused(setting: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="bad sampling settings: .*temp finite"):
        SamplerSettings(**setting)


@pytest.mark.parametrize("setting", ["rotate", "layers", "type_swa", "clip", "dither"])
def test_an_empty_kv_spec_is_refused(setting: str) -> None:
    # the C API reads "" as the model's setting: from Python that is None, and "" an empty variable passed on
    with pytest.raises(ValueError, match=f"KvConfig {setting}=' ': an empty spec; None lets the model's setting"):
        KvConfig("kivi2", "kivi2", **{setting: " "})


@pytest.mark.parametrize(("setting", "message"), [
    ({"clip": 0.9}, r'KvConfig clip=0.9: give a spec string such as "k:\*=0.9'),
    ({"layers": 2}, "KvConfig layers=2: give a spec string or None")])
def test_a_kv_spec_that_is_not_a_string_is_refused(setting: dict[str, object], message: str) -> None:
    # a number reached the C API's string handling at context creation: AttributeError 'float' ... 'encode'
    with pytest.raises(TypeError, match=message):
        KvConfig("kivi2", "kivi2", **setting)


@pytest.mark.parametrize(("dither", "spec"), [(0.5, "0.5"), (1, "1"), (0, "0"), (0.25, "0.25")])
def test_a_dither_spread_may_be_a_number(dither: float, spec: str) -> None:
    # 0 too: a spread of 0 rounds to nearest, where `or ""` would have let the model's kvq.kv_dither apply
    assert KvConfig("kivi1", "kivi1", dither=dither).dither == spec
