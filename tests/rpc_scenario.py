"""One run of every cache operation, on the CPU or on an RPC device: prefill, several sequences, copies (the
next graph maybe still running), suffix removal, keep, per-sequence and whole state, decode; prints every logit row
it saw as one .npy file. Run by tests/test_rpc.py in a subprocess per device (an RPC device, once added,
stays in the process).

    python rpc_scenario.py MODEL TEXT OUT.npy KV_LAYERS {streams,unified} [--rpc ENDPOINT] [--recurrent]

--recurrent: a hybrid model's memory, whose recurrent state cannot drop a suffix (upstream refuses): no removal.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pykvq import ContextConfig, KvConfig, Model


def scenario(model: Model, text: str, kv: KvConfig, unified: bool, removes: bool = True) -> list[np.ndarray]:
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
        if removes:
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("text", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("layers")
    parser.add_argument("layout", choices=["streams", "unified"])
    parser.add_argument("--rpc")
    parser.add_argument("--recurrent", action="store_true")
    args = parser.parse_args()
    kv = KvConfig("kivi2", "kivi2", window=64, sinks=4, layers=args.layers or None)
    with Model(args.model, n_gpu_layers=99 if args.rpc else 0, rpc=args.rpc) as model:
        seen = scenario(model, args.text.read_text()[40000:52000], kv, args.layout == "unified", not args.recurrent)
    np.save(args.out, np.concatenate([np.atleast_2d(s) for s in seen]))


if __name__ == "__main__":
    main()
