"""One run of every cache operation, on the CPU or on an RPC device: prefill, several sequences, copies (the
next graph maybe still running), suffix removal, keep, per-sequence and whole state, decode; prints every logit row
it saw as one .npy file. Run by tests/test_rpc.py in a subprocess per device (an RPC device, once added,
stays in the process).

    python rpc_scenario.py MODEL TEXT OUT.npy KV_LAYERS UNIFIED [RPC_ENDPOINT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pykvq import ContextConfig, KvConfig, Model


def scenario(model: Model, text: str, kv: KvConfig, unified: bool) -> list[np.ndarray]:
    tokens = model.tokenize(text)
    a, b, c = tokens[:300], tokens[300:600], tokens[600:900]
    # ubatches of 32: several per batch, and on Gemma 3's shape the sliding-window cache's parts (96 + 32 + two
    # rings of 64 = 256 cells) drop cells that left the window once sequence 0 passes them
    config = ContextConfig(n_ctx=3 * 512, n_ubatch=32, n_threads=2, kv=kv, n_seq_max=3, kv_unified=unified)
    seen = []
    with model.context(config) as ctx:
        seen.append(ctx.eval_seqs({0: a[:133]})[0])
        ctx.seq_cp(0, 1)  # right behind the prefill's graph
        seen += ctx.eval_seqs({0: a[133:150], 1: b[:40]}).values()
        ctx.seq_rm(1, 133 + 40 - 1)  # the last token: within the window's slack
        ctx.seq_cp(0, 2)
        seen += ctx.eval_seqs({1: b[40:41], 2: c[:64]}).values()
        one = ctx.save_seq_state(1)
        ctx.seq_keep(2)
        seen.append(ctx.eval_seqs({2: c[64:70]})[2])
        ctx.load_seq_state(one, 0)
        seen += ctx.eval_seqs({0: a[150:160], 2: c[70:71]}).values()
        whole = ctx.save_state()
    with model.context(config) as ctx:
        ctx.load_state(whole)
        seen += ctx.eval_seqs({0: a[160:165], 2: c[71:80]}).values()
        seen += ctx.eval_seqs({0: a[165:300], 2: c[80:90]}).values()
        seen += [ctx.eval_seqs({0: c[i:i + 1]})[0] for i in range(90, 100)]
    return seen


def main() -> None:
    model_path, text_path, out, layers, unified = sys.argv[1:6]
    rpc = sys.argv[6] if len(sys.argv) > 6 else None
    kv = KvConfig("kivi2", "kivi2", window=64, sinks=4, layers=layers or None)
    with Model(model_path, n_gpu_layers=99 if rpc else 0, rpc=rpc) as model:
        seen = scenario(model, Path(text_path).read_text()[40000:52000], kv, unified == "unified")
    np.save(out, np.concatenate([np.atleast_2d(s) for s in seen]))


if __name__ == "__main__":
    main()
