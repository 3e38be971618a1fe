"""llama-cpp-python 0.3.36 running on pykvq's libllama: Llama objects, its server, and the guards around them."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import pykvq
from pykvq import ChatMessage, KvConfig, Model, Sampler, SamplerSettings

import device
from server_process import free_port, wait_for

# not imported here: pykvq.llama_cpp must point it at our library first
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (.ci/run installs it)", allow_module_level=True)

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"
N_PREDICT = 40


@pytest.fixture(scope="module")
def llm(smollm2: Path):
    from pykvq.llama_cpp import Llama
    return Llama(model_path=str(smollm2), n_ctx=1024, n_threads=2, verbose=False, logits_all=True,
                 type_k=pykvq.GGML_TYPE_KIVI2, type_v=pykvq.GGML_TYPE_KIVI2, kv_window=32, **device.LLAMA_KWARGS)


KIVI2_W32 = KvConfig.preset("kivi2", window=32)


def ours(model: Model, tokens: list[int]) -> str:
    with model.context(device.context_config(n_ctx=1024, n_threads=2, kv=KIVI2_W32)) as ctx:
        return "".join(ctx.generate_text(tokens, N_PREDICT, Sampler(SamplerSettings(temp=0))))


def our_chat_reply(model: Model) -> str:
    prompt = model.apply_chat_template([ChatMessage("user", QUESTION)])
    return ours(model, model.tokenize(prompt, parse_special=True))


def test_llama_is_the_upstream_class_on_our_library(llm) -> None:
    import llama_cpp

    from pykvq import paths
    assert isinstance(llm, llama_cpp.Llama)
    assert Path(llama_cpp.llama_cpp._lib._name).resolve() == paths.library("llama").resolve()


def test_create_completion_equals_our_generation(llm, model: Model) -> None:
    out = llm.create_completion(PROMPT, max_tokens=N_PREDICT, temperature=0)
    assert out["choices"][0]["text"] == ours(model, model.tokenize(PROMPT))


def test_create_chat_completion_equals_our_generation(llm, model: Model) -> None:
    out = llm.create_chat_completion([{"role": "user", "content": QUESTION}], max_tokens=N_PREDICT, temperature=0)
    reply = out["choices"][0]["message"]["content"]
    assert "Paris" in reply
    assert reply == our_chat_reply(model).strip()


def test_logits_equal_our_bindings(llm, model: Model, hamlet: Path) -> None:
    tokens = model.tokenize(hamlet.read_text()[30000:32000])[:300]
    llm.reset()
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[:len(tokens)])
    with model.context(device.context_config(n_ctx=1024, n_batch=512, n_threads=2, kv=KIVI2_W32)) as ctx:
        mine = ctx.eval(tokens, all_logits=True)
    np.testing.assert_array_equal(theirs, mine)


def test_per_layer_types_reach_the_cache(smollm2: Path, model: Model) -> None:
    from pykvq.bindings import native
    from pykvq.llama_cpp import Llama
    llm = Llama(model_path=str(smollm2), n_ctx=1024, verbose=False, type_k=pykvq.GGML_TYPE_KIVI2,
                type_v=pykvq.GGML_TYPE_KIVI2, kv_layers="asymkv:16/0", **device.LLAMA_KWARGS)
    lib = native.libs()
    info = lib.ffi.new("struct llama_kvq_memory_info *")
    assert lib.llama.llama_kvq_memory_info(lib.ffi.cast("struct llama_context *", llm._ctx.ctx), info)
    with model.context(device.context_config(n_ctx=1024, kv=KvConfig("kivi2", "kivi2", layers="asymkv:16/0"))) as ctx:
        assert info.bytes == ctx.memory().bytes
    with model.context(device.context_config(n_ctx=1024, kv=KvConfig.preset("kivi2"))) as ctx:
        assert info.bytes < ctx.memory().bytes


def test_a_calibrated_copy_loads_with_its_own_types(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """A copy's kvq.kv_layers (pykvq calibrate, convert) applies where no kv_layers is given, and is kivi: without
    flash_attn=True the Llama and the server failed at context creation ("KV cache f16/f16: kivi types need flash
    attention"); llama-cpp-python's default leaves it off."""
    from pykvq import gguf_metadata
    from pykvq.llama_cpp import Llama
    from pykvq.llama_cpp.server import server_argv
    copy = tmp_path / "copy.gguf"
    gguf_metadata.write_copy(smollm2, copy, {gguf_metadata.KEY_LAYERS: "k:*=kivi4;v:*=kivi2"})
    llm = Llama(model_path=str(copy), n_ctx=1024, n_threads=2, verbose=False, logits_all=True, kv_window=32,
                **device.LLAMA_KWARGS)
    with device.load_model(copy) as model:
        tokens = model.tokenize(hamlet.read_text()[30000:32000])[:300]
        llm.eval(tokens)
        config = device.context_config(n_ctx=1024, n_batch=512, n_threads=2, kv=KvConfig(window=32))
        with model.context(config) as ctx:
            np.testing.assert_array_equal(np.asarray(llm.scores[:len(tokens)]), ctx.eval(tokens, all_logits=True))
    llm.close()
    assert server_argv(["--model", str(copy)])[0][-2:] == ["--flash_attn", "true"]
    # a type given wins over the copy's, as in `pykvq run`: --kv-type f16 ran its kivi mix
    rest, settings = server_argv(["--model", str(copy), "--kv-type", "f16"])
    assert settings["kv_layers"] == "none" and "--flash_attn" not in rest
    assert "--flash_attn" not in server_argv(["--model", str(smollm2)])[0]
    with pytest.raises(ValueError, match=r"the model's kvq.kv_layers \(k:\*=kivi4;v:\*=kivi2\) are read by the "
                                         r"fused attention only: pass flash_attn=True"):
        Llama(model_path=str(copy), flash_attn=False, verbose=False)


def test_a_dither_spread_may_be_a_number(smollm2: Path) -> None:
    from pykvq.llama_cpp import Llama
    llm = Llama(model_path=str(smollm2), n_ctx=256, verbose=False, type_k=pykvq.GGML_TYPE_KIVI1,
                type_v=pykvq.GGML_TYPE_KIVI1, kv_dither=0.5, **device.LLAMA_KWARGS)
    llm.close()


def test_a_closed_llama_refuses_what_would_reach_freed_memory(smollm2: Path) -> None:
    """Upstream's close() frees the model and context and keeps their pointers: a completion after it crashed the
    process (status -11), with any KV type."""
    from pykvq.llama_cpp import Llama
    llm = Llama(model_path=str(smollm2), n_ctx=256, verbose=False, **device.LLAMA_KWARGS)
    llm.close()
    closed = "this Llama is closed: close\\(\\) freed its model and context"
    for call in (lambda: llm.create_completion("Hi", max_tokens=3), lambda: llm.create_chat_completion(
            [{"role": "user", "content": "Hi"}], max_tokens=3), lambda: llm.eval([1, 2]), llm.n_ctx,
                 llm.save_state, llm.reset):
        with pytest.raises(RuntimeError, match=closed):
            call()
    llm.close()  # twice is harmless, as upstream's


def test_a_sliding_window_type_on_a_model_without_them_is_named(smollm2: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """kv_type_swa on SmolLM2 was accepted without a word, where pykvq run says it changes nothing."""
    from pykvq.llama_cpp import Llama
    Llama(model_path=str(smollm2), n_ctx=256, verbose=False, type_k=pykvq.GGML_TYPE_KIVI2,
          type_v=pykvq.GGML_TYPE_KIVI2, kv_type_swa="q8_0", **device.LLAMA_KWARGS).close()
    assert f"kv_type_swa q8_0 changes nothing: {smollm2.name} has no sliding-window layers" in caplog.text


def test_unknown_type_int_is_refused(smollm2: Path) -> None:
    from pykvq.llama_cpp import Llama
    with pytest.raises(ValueError, match=r"unknown KV cache type 99; valid: .*43 \(kivi2\)"):
        Llama(model_path=str(smollm2), type_k=99, type_v=99, verbose=False)


def test_embedding_with_a_kivi_cache_is_refused_before_the_model_loads(smollm2: Path) -> None:
    """embedding=True makes llama-cpp-python ask for 256 sequences in one unified cache: llama.cpp refused with "512
    cells for 256 sequences", naming a sequence count the caller never gave. An f16 cache embeds."""
    from pykvq.llama_cpp import Llama
    with pytest.raises(ValueError, match="embedding=True packs .* embed with an f16 or q8_0 KV cache"):
        Llama(model_path=str(smollm2), embedding=True, type_k=pykvq.GGML_TYPE_KIVI2, type_v=pykvq.GGML_TYPE_KIVI2,
              verbose=False)
    embedder = Llama(model_path=str(smollm2), embedding=True, verbose=False, **device.LLAMA_KWARGS)
    assert len(embedder.create_embedding(["one text", "another"])["data"]) == 2


@pytest.mark.parametrize(("setting", "message"), [
    ({"kv_window": -1}, "the recent window must be 0 or more tokens, got -1"),
    ({"kv_sinks": -2}, "the sink count must be 0 or more tokens, got -2"),
    ({"kv_rotate": "bogus"}, "rotation 'bogus' is neither on/off nor a per-layer spec"),
    ({"kv_type_swa": "kivi9"}, "unknown KV cache type 'kivi9' for the sliding-window cache"),
    ({"type_v": 1}, r"a kivi K type needs a kivi V type and the other way round: type_k 43 \(kivi2\) and type_v 1 "
                    r"\(f16\)"),
], ids=["window", "sinks", "rotate", "type-swa", "kivi-k-f16-v"])
def test_bad_kv_settings_are_refused_before_llama_cpp_python_allocates(smollm2: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       setting: dict, message: str) -> None:
    """They were refused inside upstream's __init__, whose __del__ then failed on the half-built Llama four times
    ("Exception ignored in ... no attribute '_stack'"); a kivi K beside an f16 V was told to pass flash_attn=True."""
    from pykvq.llama_cpp import Llama
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(ValueError, match=message):
        Llama(model_path=str(smollm2), verbose=False, flash_attn=False,
              **{"type_k": pykvq.GGML_TYPE_KIVI2, "type_v": pykvq.GGML_TYPE_KIVI2, **setting})
    gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []


@pytest.mark.parametrize(("name", "hint"), [("kivi2", r"pykvq\.GGML_TYPE_KIVI2 \(43\)"),
                                            ("q8_0", r"\(8\)")])
def test_a_type_name_is_refused_with_its_id(smollm2: Path, name: str, hint: str) -> None:
    from pykvq.llama_cpp import Llama
    with pytest.raises(ValueError, match=f"take a ggml type id, not a name: for '{name}' pass {hint}"):
        Llama(model_path=str(smollm2), type_k=name, type_v=name, verbose=False)


def _served_answer(smollm2: Path, tmp_path: Path, args: list[str], path: str, body: dict) -> tuple[dict, str]:
    """The server's answer to one request, and its log."""
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pykvq.llama_cpp.server", "--model", str(smollm2), "--kv-type", "kivi2",
             "--host", "127.0.0.1", "--port", str(port), "--n_threads", "2", "--verbose", "true", *args],
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            wait_for(f"http://127.0.0.1:{port}/v1/models", proc, 60)
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.load(response), log.read_text()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _served_chat_reply(smollm2: Path, tmp_path: Path, args: list[str]) -> tuple[str, str]:
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": N_PREDICT, "temperature": 0}
    answer, log = _served_answer(smollm2, tmp_path, ["--kv-window", "32", "--n_ctx", "1024", *args],
                                 "/v1/chat/completions", body)
    return answer["choices"][0]["message"]["content"], log


def test_server_answers_a_chat_completion_with_kivi2(smollm2: Path, model: Model, tmp_path: Path) -> None:
    reply, log = _served_chat_reply(smollm2, tmp_path, [])
    assert reply == our_chat_reply(model).strip()
    assert "K (kivi2)" in log and "V (kivi2)" in log


def test_the_server_offloads_to_its_rpc_servers(rpc_server: str, smollm2: Path, model: Model, tmp_path: Path) -> None:
    """--rpc_servers with --n_gpu_layers: upstream's Llama, which the server created, dropped the servers without a
    word (llama.cpp registers them as devices now) and "offloaded" every layer to the CPU. The model's layers and
    its kivi cache go to the RPC server's device, and the reply is the CPU's."""
    reply, log = _served_chat_reply(smollm2, tmp_path, ["--rpc_servers", rpc_server, "--n_gpu_layers", "99"])
    assert f"RPC0[{rpc_server}] model buffer size" in log and f"RPC0[{rpc_server}] KV buffer size" in log
    assert reply == our_chat_reply(model).strip()


def _repeat_prompt(hamlet: Path) -> str:
    """A prompt whose continuation is in it: prompt-lookup decoding drafts from it, and some drafts are rejected."""
    text = hamlet.read_text()[5000:5800]
    return f"Repeat this text exactly:\n{text}\n\nRepeat:\n{text[:300]}"


def _kivi2_llama(smollm2: Path, **kwargs):
    from pykvq.llama_cpp import Llama
    return Llama(model_path=str(smollm2), n_ctx=1024, n_threads=2, verbose=False, type_k=pykvq.GGML_TYPE_KIVI2,
                 type_v=pykvq.GGML_TYPE_KIVI2, **device.LLAMA_KWARGS, **kwargs)


def _prompt_lookup(num_pred_tokens: int):
    from pykvq.llama_cpp import load
    load()  # before anything of llama_cpp is imported
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    return LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens)


def _completion(llm, prompt: str) -> str:
    return llm.create_completion(prompt, max_tokens=48, temperature=0)["choices"][0]["text"]


@pytest.mark.parametrize("n_batch", [512, 128])
def test_prompt_lookup_decoding_removes_its_rejected_drafts_exactly(smollm2: Path, hamlet: Path, n_batch: int) -> None:
    """llama-cpp-python's speculative decoding removes the drafted tokens the model rejects: the kivi ring's default
    slack (one token) refused that, and the next decode failed ("llama_decode returned -1"). The draft model's
    length now sets kv_rollback; the text is the one generated without drafts. A prompt over n_batch tokens (128)
    failed in upstream's eval ("could not broadcast input array"), whose scores kept n_batch rows."""
    prompt = _repeat_prompt(hamlet)
    plain = _completion(_kivi2_llama(smollm2, n_batch=n_batch), prompt)
    assert _completion(_kivi2_llama(smollm2, n_batch=n_batch, draft_model=_prompt_lookup(8)), prompt) == plain


def test_the_server_s_draft_model_sets_the_rollback(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """The server's --draft_model proposes --draft_model_num_pred_tokens tokens at a time: its Llama keeps that many
    removable, and the completion is the one generated without drafts."""
    prompt = _repeat_prompt(hamlet)
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "repeat_penalty": 1.0}
    args = ["--n_ctx", "1024", "--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "8"]
    answer, _ = _served_answer(smollm2, tmp_path, args, "/v1/completions", body)
    assert answer["choices"][0]["text"] == _completion(_kivi2_llama(smollm2), prompt)


def test_a_refused_removal_says_what_to_do_and_keeps_the_token_count_in_sync(smollm2: Path, hamlet: Path) -> None:
    """An explicit kv_rollback=0 is kept: the first rejected draft deeper than the ring's slack is refused with the
    cache's reason and the setting that allows it, and the next completion starts over cleanly."""
    llm = _kivi2_llama(smollm2, draft_model=_prompt_lookup(8), kv_rollback=0)
    refused = r"cannot go back to token \d+ of \d+: .*cannot remove tokens.*kv_rollback=N"
    with pytest.raises(RuntimeError, match=refused):
        _completion(llm, _repeat_prompt(hamlet))
    import llama_cpp
    memory = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert llm.n_tokens == llama_cpp.llama_memory_seq_pos_max(memory, 0) + 1
    assert _completion(llm, PROMPT) == _completion(_kivi2_llama(smollm2), PROMPT)


def _fake_llama_cpp(root: Path, version: str, lib: str) -> Path:
    root = root / "site"
    pkg = root / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\nfrom . import llama_cpp\n")
    (pkg / "llama_cpp.py").write_text(f"class _Lib:\n    _name = {lib!r}\n_lib = _Lib()\n")
    return root


def _python_path_first(folder: Path) -> str:
    """PYTHONPATH with ``folder`` ahead of what it already holds (where pykvq's own dependencies may be)."""
    return os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])


def _load_in_subprocess(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    # cwd: not the checkout, whose pykvq folder (no built libraries) would shadow the installed package
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=cwd)


LOAD = ("import pykvq.llama_cpp as p\ntry:\n    p.load()\nexcept p.LlamaCppError as e:\n    print(e)\n"
        "    raise SystemExit(3)\n")


@pytest.mark.parametrize("case, message", [
    ("other-lib-path", "names another libllama than pykvq's"),
    ("other-mtmd-path", "names another libmtmd than pykvq's"),
    ("imported-first", "was imported before pykvq.llama_cpp and runs on /opt/other/libllama.so"),
    ("wrong-version", "llama-cpp-python 0.2.90 is installed"),
    ("missing", "llama-cpp-python is not installed"),
])
def test_load_refuses_the_wrong_library(case: str, message: str, tmp_path: Path) -> None:
    env: dict[str, str] = {}
    code = LOAD
    if case == "other-lib-path":
        env["LLAMA_CPP_LIB_PATH"] = str(tmp_path)
    elif case == "other-mtmd-path":
        env["MTMD_CPP_LIB"] = str(tmp_path)
    elif case == "imported-first":
        env["PYTHONPATH"] = _python_path_first(_fake_llama_cpp(tmp_path, "0.3.36", "/opt/other/libllama.so"))
        code = "import llama_cpp\n" + LOAD
    elif case == "wrong-version":
        from pykvq import paths
        env["PYTHONPATH"] = _python_path_first(_fake_llama_cpp(tmp_path, "0.2.90", str(paths.library("llama"))))
    else:
        code = "import sys\nsys.modules['llama_cpp'] = None\n" + LOAD
    proc = _load_in_subprocess(code, env, tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert message in proc.stdout


def test_a_refused_state_load_leaves_the_token_count_in_sync(smollm2: Path, llm) -> None:
    """llama-cpp-python sets n_tokens before loading: after a refusal it named tokens the cache no longer held,
    and the next call with the same prompt "reused" them."""
    from pykvq.llama_cpp import Llama
    llm.reset()
    llm.create_completion(PROMPT, max_tokens=4, temperature=0)
    state = llm.save_state()
    other = Llama(model_path=str(smollm2), n_ctx=1024, n_threads=2, verbose=False, type_k=pykvq.GGML_TYPE_KIVI2,
                  type_v=pykvq.GGML_TYPE_KIVI2, kv_window=64, **device.LLAMA_KWARGS)
    fresh = other.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    # llama-cpp-python's own message, then the cache's reason
    with pytest.raises(RuntimeError, match=r"Failed to set llama state data: kivi KV cache: cannot load this state: "
                                           r"it was saved with .*window 32.*; this cache has .*window 64"):
        other.load_state(state)
    assert other.n_tokens == 0
    assert other.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"] == fresh



def test_our_errors_keep_their_reason_once_llama_cpp_python_shares_the_library(llm, model: Model) -> None:
    """Importing llama_cpp sets its own log callback (one per process): pykvq's exceptions lost llama.cpp's
    reasons in every later test of the same process ("cannot create the context")."""
    from pykvq import LlamaError
    config = device.context_config(n_ctx=256, n_threads=2, kv=KvConfig.preset("kivi2"), n_seq_max=16,
                                   kv_unified=True)
    with pytest.raises(LlamaError, match="kivi types need a multiple of 32 cells"):
        model.context(config)


def test_llama_cpp_python_still_gets_the_log(smollm2: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from pykvq.llama_cpp import Llama
    with pytest.raises(ValueError, match="Failed to create llama_context: .*the model has 30 layers"):
        # refused by llama.cpp while it creates the context
        Llama(model_path=str(smollm2), n_ctx=256, n_threads=2, verbose=True, kv_layers="k:0-99=kivi2;v:*=kivi2",
              type_k=pykvq.GGML_TYPE_KIVI2, type_v=pykvq.GGML_TYPE_KIVI2, **device.LLAMA_KWARGS)
    assert "the model has 30 layers (0-29)" in capfd.readouterr().err


def test_loading_llama_cpp_python_keeps_pykvq_s_own_api_quiet(smollm2: Path, tmp_path: Path) -> None:
    """llama-cpp-python's log callback prints every line until a Llama sets its level: with it installed, pykvq's
    Model printed llama.cpp's whole log (about 2,400 lines for a load and an eval)."""
    code = ("import pykvq.llama_cpp as lc, sys\nlc.load()\nfrom pykvq import Model\n"
            "with Model(sys.argv[1], n_gpu_layers=0) as m, m.context() as c:\n    c.eval(m.tokenize('Hello there'))\n")
    proc = subprocess.run([sys.executable, "-P", "-c", code, str(smollm2)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("\n") < 10, proc.stderr[:3000]


@pytest.mark.parametrize(("args", "expected"), [
    (["--kv-type", "kivi2+rot"], "True none None --type_k 43 --type_v 43 --flash_attn true"),
    (["--kv-type", "asymkv:16/0"], "None asymkv:16/0 None --type_k 43 --type_v 43 --flash_attn true"),
    (["--kv-type", "kivi2", "--kv-layers", "k:*=kivi4;v:*=kivi2"],
     "None k:*=kivi4;v:*=kivi2 None --type_k 43 --type_v 43 --flash_attn true"),
    (["--kv-type", "kivi2", "--kv-rollback", "0", "--draft_model", "prompt-lookup-decoding"],
     "None none 0 --draft_model prompt-lookup-decoding --type_k 43 --type_v 43 --flash_attn true"),
    (["--kv-layers", "k:*=kivi4;v:*=f16"], "None k:*=kivi4;v:*=f16 None --flash_attn true"),
    (["--type_k", "43", "--type_v", "43"], "None none None --type_k 43 --type_v 43 --flash_attn true"),
], ids=["rotation", "asymkv", "kv-layers", "explicit-rollback", "layers-alone", "type-ids"])
def test_the_server_takes_every_part_of_the_kv_type(args: list[str], expected: str) -> None:
    """`--kv-type asymkv:16/0` ran as uniform kivi2 and `kivi2+rot` without rotation: the server dropped the
    parts after the type name. An explicit --kv-rollback is kept beside a --draft_model (whose own length sets it
    otherwise, in the Llama)."""
    from pykvq.llama_cpp.server import server_argv
    rest, settings = server_argv(args)
    got = f"{settings['kv_rotate']} {settings['kv_layers']} {settings['kv_rollback']} {' '.join(rest)}"
    assert got == expected.replace("43", str(pykvq.GGML_TYPE_KIVI2))


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-type", "kivi2", "--flash_attn", "false"], r"kivi KV types are read by the fused attention only: drop "
                                                      r"--flash_attn false"),
    (["--type_k", "43", "--type_v", "43", "--flash_attn=off"], "drop --flash_attn off"),
    (["--type_k", "43", "--type_v", "1"], r"a kivi K type needs a kivi V type .*type_k 43 \(kivi2\) and type_v 1"),
], ids=["kv-type", "type-ids", "kivi-k-f16-v"])
def test_the_server_refuses_what_the_llama_refuses(args: list[str], message: str) -> None:
    """--flash_attn false beside a kivi type started the server with flash attention on, where Llama refuses it;
    a kivi K beside an f16 V was told to pass flash_attn=True."""
    from pykvq.llama_cpp.server import server_argv
    with pytest.raises(ValueError, match=message):
        server_argv([arg.replace("43", str(pykvq.GGML_TYPE_KIVI2)) for arg in args])


def test_the_server_s_help_lists_pykvq_s_options_then_llama_cpp_server_s() -> None:
    proc = subprocess.run([sys.executable, "-P", "-m", "pykvq.llama_cpp.server", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ours = [f"--kv-{name}" for name in ("type", "window", "sinks", "rollback", "rotate", "layers", "clip", "dither",
                                        "type-swa")]
    assert all(flag in proc.stdout for flag in ours), proc.stdout
    assert proc.stdout.index("--kv-type-swa") < proc.stdout.index("usage: python -m llama_cpp.server")
    assert "--n_ctx" in proc.stdout


@pytest.mark.parametrize("name", ["kv_type", "kv_windw"])
def test_a_kv_argument_llama_does_not_take_is_refused(smollm2: Path, name: str) -> None:
    """Upstream's Llama takes any keyword and drops it: kv_type="kivi2" ran an f16 cache without a word."""
    from pykvq.llama_cpp import Llama
    with pytest.raises(TypeError, match=f"unexpected keyword arguments {name}: the KV types are type_k and type_v"):
        Llama(model_path=str(smollm2), **{name: "kivi2"})
