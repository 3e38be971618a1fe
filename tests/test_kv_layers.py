"""Per-layer K and V types: the spec language, what the cache allocates, AsymKV's finding, and metadata."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, LlamaError, Model, gguf_metadata, kv_types, llama_tools, paths
from pykvq.kv_types import bits_per_element

import device

N_LAYER = 30  # SmolLM2-135M


def resolve(spec: str, n_layer: int = N_LAYER, default: str = "f16") -> tuple[list[str], list[str]]:
    return kv_types.layer_types(spec, n_layer, default, default)


def test_asymkv_notation() -> None:
    k, v = resolve("asymkv:16/0")
    assert k == ["kivi2"] * 16 + ["kivi1"] * 14 and v == ["kivi1"] * 30
    k, v = resolve("asymkv:0/30")
    assert k == ["kivi1"] * 30 and v == ["kivi2"] * 30


def test_general_form_and_defaults() -> None:
    k, v = resolve("k:0-3=kivi4, 4=q8_0, 5-=kivi2; v:*=kivi1", n_layer=8, default="q4_0")
    assert k == ["kivi4"] * 4 + ["q8_0"] + ["kivi2"] * 3 and v == ["kivi1"] * 8
    k, v = resolve("v:*=kivi2", n_layer=4, default="kivi4")
    assert k == ["kivi4"] * 4 and v == ["kivi2"] * 4
    assert resolve("none", n_layer=2) == (["f16"] * 2, ["f16"] * 2)


@pytest.mark.parametrize("spec, message", [
    ("k:0-15=kivi3;v:*=kivi1", "in '0-15=kivi3': unknown type 'kivi3' (valid: f32, f16"),
    ("k:0-40=kivi2", "in '0-40=kivi2': the model has 30 layers (0-29)"),
    ("k:0-15=kivi2,12-=kivi1", "in '12-=kivi1': k: layer 12 already has a type from '0-15=kivi2'"),
    ("k:0-15=kivi2,20-=kivi1", "in 'k:': layers 16-19 have no type"),
    ("k:0-28=kivi2", "in 'k:': layer 29 has no type"),
    ("k:0-15 kivi2", "in '0-15 kivi2': expected LAYERS=TYPE"),
    ("k:a-3=kivi2", "in 'a-3=kivi2': 'a' is not a layer number"),
    ("k:9-3=kivi2", "in '9-3=kivi2': the range 9-3 runs backwards"),
    ("k:*=kivi2;k:*=kivi1", "in 'k:*=kivi1': the k: part is given twice"),
    ("x:*=kivi2", "in 'x:*=kivi2': a part starts with k: or v:"),
    ("asymkv:16", "expected asymkv:L_K/L_V"),
    ("asymkv:31/0", "in 'asymkv: L_K = 31': more layers than the model's 30"),
])
def test_bad_specs_point_at_the_offending_part(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve(spec)
    assert message in str(err.value)
    assert str(err.value).startswith(f"layer types '{spec}'")


def cache_bytes(model: Model, kv: KvConfig, n_ctx: int = 1024) -> int:
    with model.context(device.context_config(n_ctx=n_ctx, kv=kv)) as ctx:
        return ctx.memory().bytes


def test_each_layer_allocates_its_own_types(model: Model) -> None:
    spec = "k:0-9=kivi4,10-19=kivi2,20-=kivi1;v:0-4=kivi1,5-=kivi2"
    window, sinks, n_ctx = 64, 4, 1024
    n_embd = 3 * 64  # per layer, K and V alike
    k, v = resolve(spec)
    expected = sum(bits_per_element(t, n_ctx, window, sinks) * n_ctx * n_embd / 8 for t in k + v)
    got = cache_bytes(model, KvConfig("kivi2", "kivi2", window, sinks, layers=spec), n_ctx)
    assert expected <= got <= expected + 4 * N_LAYER * 512


def test_upstream_types_mix_per_layer(model: Model) -> None:
    spec = "k:0-14=q8_0,15-=f16;v:0-14=q8_0,15-=f16"
    q8, f16 = cache_bytes(model, KvConfig.preset("q8_0", layers="none")), cache_bytes(model, KvConfig())
    assert cache_bytes(model, KvConfig(layers=spec)) == pytest.approx((q8 + f16) / 2, rel=1e-3)


def test_per_layer_spec_of_one_type_equals_that_type(model: Model, hamlet: Path) -> None:
    tokens = model.tokenize(hamlet.read_text()[30000:32000])[:300]

    def logits(kv: KvConfig) -> np.ndarray:
        with model.context(device.context_config(n_ctx=512, n_threads=2, kv=kv)) as ctx:
            return ctx.eval(tokens, all_logits=True)

    np.testing.assert_array_equal(logits(KvConfig("kivi4", "kivi4", 32, layers="k:*=kivi2;v:*=kivi1")),
                                  logits(KvConfig("kivi2", "kivi1", 32, layers="none")))


def ppl(smollm2: Path, hamlet: Path, *args: str) -> float:
    out = llama_tools.run_tool("llama-perplexity", [*device.TOOL_ARGS,
                                                    "-m", str(smollm2), "-f", str(hamlet), "-c", "512", "-b", "512",
                                                    "--chunks", "2", "-t", "2", "-fa", "on", "-ctk", "kivi2", "-ctv",
                                                    "kivi2", *args])
    return llama_tools.parse_perplexity(out).ppl


def test_asymkv_k_high_beats_v_high_at_equal_memory(smollm2: Path, hamlet: Path) -> None:
    """AsymKV's central finding (bench/results/asymkv-c2048.json has the sweep): measured here 57 vs 561."""
    k_high = ppl(smollm2, hamlet, "--kv-layers", "asymkv:30/0")
    v_high = ppl(smollm2, hamlet, "--kv-layers", "asymkv:0/30")
    assert np.isfinite(k_high) and k_high * 3 < v_high


def test_bad_spec_in_the_tools_is_one_clear_error(smollm2: Path, hamlet: Path) -> None:
    proc = subprocess.run([str(paths.tool("llama-perplexity")), "-m", str(smollm2), "-f", str(hamlet),
                           "-c", "256", "-b", "256", "-fa", "on", "--kv-layers", "k:0-40=kivi2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "'0-40=kivi2': the model has 30 layers (0-29)" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def tagged(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kvq") / "tagged.gguf"
    gguf_metadata.write_copy(smollm2, out, {gguf_metadata.KEY_LAYERS: "asymkv:20/5", "kvq.kv_budget": 1.75,
                                            "kvq.calibration.kld_k_kivi2": [0.5] * N_LAYER})
    return out


def test_metadata_round_trips(tagged: Path) -> None:
    meta = gguf_metadata.read_kvq(tagged)
    assert meta["kvq.version"] == gguf_metadata.KVQ_VERSION and meta[gguf_metadata.KEY_LAYERS] == "asymkv:20/5"
    assert meta["kvq.kv_budget"] == pytest.approx(1.75) and meta["kvq.calibration.kld_k_kivi2"] == [0.5] * N_LAYER


def test_the_cache_allocates_the_metadata_layers(tagged: Path, model: Model) -> None:
    with device.load_model(tagged) as m:
        from_metadata = cache_bytes(m, KvConfig("kivi2", "kivi2"))
        ignored = cache_bytes(m, KvConfig("kivi2", "kivi2", layers="none"))
    assert from_metadata == cache_bytes(model, KvConfig("kivi2", "kivi2", layers="asymkv:20/5"))
    assert ignored == cache_bytes(model, KvConfig("kivi2", "kivi2"))
    assert from_metadata < ignored


def test_metadata_of_another_version_is_refused(smollm2: Path, tmp_path: Path) -> None:
    future = tmp_path / "future.gguf"
    gguf_metadata.write_copy(smollm2, future, {"kvq.version": 5, gguf_metadata.KEY_LAYERS: "asymkv:20/5"})
    with pytest.raises(gguf_metadata.GgufError, match="version 5; this pykvq reads versions 1 to 4"):
        gguf_metadata.read_kvq(future)
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS,
                           "-m", str(future), "-p", "hi", "-n", "2"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "version 5; this pykvq reads versions 1 to 4" in proc.stderr
    # the cache's own refusal named one flag to ignore the metadata with, then the next one under it, and so on
    with device.load_model(future) as m, pytest.raises(
            LlamaError, match=r"version 5; this pykvq reads versions 1 to 4 \(later ones come from a newer pykvq\)$"):
        m.context(device.context_config(n_ctx=256, kv=KvConfig("kivi2", "kivi2", layers="none")))


@pytest.mark.parametrize(("metadata", "message"), [
    ({gguf_metadata.KEY_WINDOW: "wide"}, "kvq.window must be a whole number from 0 to 2147483647, not 'wide'"),
    ({gguf_metadata.KEY_SINKS: 2.5}, "kvq.sinks must be a whole number from 0 to 2147483647, not 2.5"),
    ({gguf_metadata.KEY_LAYERS: 7}, "kvq.kv_layers must be a string, not int"),
], ids=["window-string", "sinks-float", "layers-int"])
def test_kvq_metadata_of_the_wrong_kind_is_one_clear_error_in_run(smollm2: Path, tmp_path: Path,
                                                                 metadata: dict[str, object], message: str) -> None:
    """`pykvq inspect` reported these cleanly while `pykvq run` gave a Python traceback."""
    odd = tmp_path / "odd.gguf"
    gguf_metadata.write_copy(smollm2, odd, metadata)
    proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-m", str(odd), "--kv-type", "kivi2", "-p", "hi",
                           "-n", "2", "-c", "256", "-t", "2"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_pykvq_run_reports_per_layer_types(smollm2: Path, tagged: Path, tmp_path: Path) -> None:
    def run(*args: str) -> str:
        proc = subprocess.run(["pykvq", "run", *device.TOOL_ARGS, "-t", "2", "-p", "Hi", "-n", "2", "-c", "512", *args],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "KV cache layers asymkv:16/0" in run("-m", str(smollm2), "--kv-type", "asymkv:16/0")
    assert "KV cache layers asymkv:20/5" in run("-m", str(tagged))
    assert "KV cache K f16, V f16" in run("-m", str(tagged), "--kv-layers", "none")


@pytest.fixture(scope="module")
def kv_heads_model(tmp_path_factory: pytest.TempPathFactory):
    with device.load_random_model(tmp_path_factory.mktemp("kv-heads"), "deci-kv-heads") as m:
        yield m


def test_layers_of_different_kv_head_counts(kv_heads_model: Model) -> None:
    """KV heads 2, 1 and 4 in one model (DeciLM's llama variant; GQA 2, 4, 1): each kivi layer holds its own
    width. With a window covering the context kivi2 is upstream's f16 within upstream's own FA on/off noise (small
    against the logits' spread); its state round trip is exact."""
    tokens = [int(t) for t in np.random.default_rng(5).integers(300, 1024, size=300)]

    def run(kv: KvConfig, flash_attn: str = "on") -> np.ndarray:
        config = device.context_config(n_ctx=512, n_batch=512, n_threads=2, kv=kv, flash_attn=flash_attn)
        with kv_heads_model.context(config) as ctx:
            return ctx.eval(tokens, all_logits=True)

    f16 = run(KvConfig())
    noise = np.abs(run(KvConfig(), flash_attn="off") - f16).max()
    assert np.abs(run(KvConfig.preset("kivi2", window=512)) - f16).max() < 2 * noise < 0.15 * f16.std()
    config = device.context_config(n_ctx=512, n_batch=512, n_threads=2, kv=KvConfig.preset("kivi2", window=32),
                                   flash_attn="on")
    with kv_heads_model.context(config) as first, kv_heads_model.context(config) as second:
        first.eval(tokens[:250])
        second.load_state(first.save_state())
        np.testing.assert_array_equal(second.eval(tokens[250:], all_logits=True),
                                      first.eval(tokens[250:], all_logits=True))
        memory = first.memory()
    # 7 KV heads of 64 over the three layers, K and V, every cell
    assert memory.n_elements == 512 * 7 * 64 * 2


@pytest.fixture(scope="module")
def settled(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with the window and sinks pykvq calibrate would write."""
    out = tmp_path_factory.mktemp("kvq") / "settled.gguf"
    gguf_metadata.write_copy(smollm2, out, {gguf_metadata.KEY_WINDOW: 32, gguf_metadata.KEY_SINKS: 4})
    return out


def kivi2_logits(path: Path, tokens: list[int], **settings: int) -> np.ndarray:
    with device.load_model(path) as m, m.context(device.context_config(n_ctx=256, n_threads=2,
                                                                      kv=KvConfig.preset("kivi2", **settings))) as ctx:
        return ctx.eval(tokens)


def test_the_python_api_takes_the_model_window_and_sinks(smollm2: Path, settled: Path, model: Model,
                                                         hamlet: Path) -> None:
    """A calibrated model's kvq.window and kvq.sinks apply wherever the caller leaves them unset, as its
    kvq.kv_layers do; given settings win."""
    tokens = model.tokenize(hamlet.read_text()[20000:22000])[:200]
    from_model = kivi2_logits(settled, tokens)
    np.testing.assert_array_equal(from_model, kivi2_logits(smollm2, tokens, window=32, sinks=4))
    assert np.abs(from_model - kivi2_logits(smollm2, tokens)).max() > 1e-3
    np.testing.assert_array_equal(kivi2_logits(settled, tokens, window=16, sinks=0),
                                  kivi2_logits(smollm2, tokens, window=16, sinks=0))


def test_the_tools_take_the_model_window_and_sinks(settled: Path, hamlet: Path) -> None:
    def log(*args: str) -> str:
        proc = subprocess.run([str(paths.tool("llama-perplexity")), *device.TOOL_ARGS, "-m", str(settled),
                               "-f", str(hamlet), "-c", "128", "-b", "128", "--chunks", "1", "-t", "2", "-fa", "on",
                               "-ctk", "kivi2", "-ctv", "kivi2", "-v", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout + proc.stderr

    assert "window = 32, sinks = 4" in log()
    assert "window = 64, sinks = 0" in log("--kv-window", "64", "--kv-sinks", "0")


@pytest.mark.parametrize("settings, message", [({"window": -1}, "recent window must be 0 or more tokens, got -1"),
                                               ({"sinks": -2}, "sink count must be 0 or more tokens, got -2")])
def test_a_negative_window_or_sink_count_is_refused(settings: dict[str, int], message: str) -> None:
    """Leaving them out is what takes the model's values; a negative count is a mistake, not a request for them."""
    with pytest.raises(ValueError, match=message):
        KvConfig.preset("kivi2", **settings).kvq_params()
