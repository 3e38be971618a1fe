"""A token of several sequences at once (a prompt decoded once for the endings that follow it, as llama-perplexity's
HellaSwag, Winogrande and multiple-choice scores batch their tasks) in a kivi cache, which keeps every sequence's
tokens apart: it goes in once per sequence, and each sequence continues as if it had been decoded alone. Judged on
the suite's device (bit for bit on the CPU, whose results do not depend on the batching)."""

from __future__ import annotations

import functools
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pykvq import KvConfig, Model, paths
from pykvq.bindings.log import sink

import device
from raw_batch import Item, decode

N_CTX = 512  # a unified cache's region per sequence: N_CTX / N_SEQ cells
N_SEQ = 4
PROMPT = 40
ENDINGS = (5, 9, 3, 7)

# windows shorter than the prompt: most of it is read from quantized tiles
KV = {
    "kivi2": KvConfig.preset("kivi2", window=32),
    "kivi1": KvConfig.preset("kivi1", window=16, sinks=4),
    "asymkv": KvConfig(type_k="kivi2", type_v="kivi1", layers="asymkv:16/0", window=32),
}


def shared_batch(prompt: list[int], endings: list[list[int]]) -> list[Item]:
    """The prompt once for every sequence, its last token an output, then each sequence's ending, every token an
    output (llama-perplexity's HellaSwag batch)."""
    seqs = tuple(range(len(endings)))
    items = [Item(t, i, seqs, i == len(prompt) - 1) for i, t in enumerate(prompt)]
    for seq, ending in enumerate(endings):
        items += [Item(t, len(prompt) + i, (seq,), True) for i, t in enumerate(ending)]
    return items


@pytest.fixture(scope="module")
def tokens() -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(300, 40000, size=PROMPT)]
    return prompt, [[int(t) for t in rng.integers(300, 40000, size=n)] for n in ENDINGS]


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("kv", list(KV), ids=list(KV))
def test_each_sequence_continues_a_shared_prompt_as_if_alone(model: Model, tokens, kv: str, unified: bool) -> None:
    """The prompt's last logits and each ending's equal those of the sequence decoded alone in a context of its
    own (the kivi cache refused the batch before). Per-sequence streams take it too, where upstream's f16 asks for a
    unified cache (-kvu)."""
    prompt, endings = tokens
    config = device.context_config(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2, kv=KV[kv],
                                   n_seq_max=N_SEQ, kv_unified=unified)
    items = shared_batch(prompt, endings)
    with model.context(config) as ctx:
        status, got = decode(ctx, items)
        assert status == 0
        assert [ctx.seq_len(seq) for seq in range(N_SEQ)] == [PROMPT + len(e) for e in endings]
    first = PROMPT
    for ending in endings:
        alone = functools.partial(device.all_logits, model, tokens=prompt + ending, n_ctx=N_CTX // N_SEQ)
        rows = [PROMPT - 1, *range(first, first + len(ending))]
        device.assert_same_logits(np.stack([got[i] for i in rows]), alone(KV[kv])[PROMPT - 1:],
                                  lambda alone=alone: alone(KvConfig())[PROMPT - 1:])
        first += len(ending)


def test_a_shared_token_of_sequences_that_diverged_is_refused_and_nothing_goes_in(model: Model, tokens) -> None:
    """Sequence 0 holds a prompt, sequence 1 nothing: a token of both is refused, with upstream's reason (coupled
    sequences that diverged: the shared token would see other histories), where its copies would each have been
    valid; neither sequence changes."""
    prompt, _ = tokens
    config = device.context_config(n_ctx=N_CTX, n_threads=2, kv=KV["kivi2"], n_seq_max=2, kv_unified=True)
    with model.context(config) as ctx:
        assert decode(ctx, [Item(t, i, (0,), False) for i, t in enumerate(prompt)])[0] == 0
        sink().take_problems()
        status, _ = decode(ctx, [Item(prompt[0], PROMPT, (0, 1), True)])
        assert status != 0
        assert any("sequence 0 is coupled to 1" in line for line in sink().take_problems())  # "but have diverged"
        assert [ctx.seq_len(0), ctx.seq_len(1)] == [PROMPT, 0]


@pytest.mark.parametrize("seqs", [(0, N_SEQ), (-1, 0), (0, 1, 2, 3, 4, 5)], ids=["past-n-seq", "negative", "too-many"])
def test_a_shared_token_of_sequences_the_context_lacks_is_refused(model: Model, tokens, seqs: tuple[int, ...]) -> None:
    """Sequence ids out of range in a shared token: refused by upstream's batch checks, as for one sequence,
    nothing goes in and the context decodes on."""
    prompt, _ = tokens
    config = device.context_config(n_ctx=N_CTX, n_threads=2, kv=KV["kivi2"], n_seq_max=N_SEQ, kv_unified=True)
    with model.context(config) as ctx:
        assert decode(ctx, [Item(t, i, seqs, False) for i, t in enumerate(prompt)])[0] != 0
        assert [ctx.seq_len(seq) for seq in range(N_SEQ)] == [0] * N_SEQ
        assert decode(ctx, shared_batch(prompt, [prompt[:3]] * 2))[0] == 0


# llama-perplexity's multiple-choice scores, each on tasks built from Hamlet with one clear answer (the line that
# follows, against lines with their words reversed; the word that was there, against a made-up one), so that a
# batch whose logits went to the wrong tokens falls to chance where every cache scores alike


def _lines(hamlet: Path) -> list[str]:
    """The play's verse lines in order, without the commas and quotes Winogrande's CSV would trip on."""
    text = hamlet.read_text(encoding="utf-8", errors="replace").splitlines()[2000:3000]
    lines = [line.strip().replace(",", "").replace('"', "") for line in text]
    return [line for line in lines if len(line) > 20]


def _garbled(line: str) -> str:
    """The line with each word spelt backwards: no model's likely continuation."""
    return " ".join(word[::-1] for word in line.split())


def _hellaswag(lines: list[str], path: Path, n: int) -> Path:
    rows = []
    for k in range(n):
        i = 10 * k
        endings = [lines[i + 2], _garbled(lines[i + 2]), _garbled(lines[i + 3]), _garbled(lines[i + 4])]
        gold = k % 4
        endings[0], endings[gold] = endings[gold], endings[0]
        rows += [lines[i] + " " + lines[i + 1], str(gold), *endings]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _winogrande(lines: list[str], path: Path, n: int) -> Path:
    rows = []
    for k in range(n):
        words = lines[10 * k + 1].split()
        sentence = lines[10 * k] + " " + " ".join([*words[:2], "_", *words[3:]])
        options = (words[2], "Zqxv") if k % 2 == 0 else ("Zqxv", words[2])
        rows.append(f"{k},{sentence},{options[0]},{options[1]},{1 + k % 2}")
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _multiple_choice(lines: list[str], path: Path, n: int) -> Path:
    """llama-perplexity's binary format: task count, task offsets, then each task's question and its single-answer
    and multiple-answer choices (strings with a 32-bit length, labels as 32-bit ints)."""

    def string(s: str) -> bytes:
        data = s.encode()
        return struct.pack("<I", len(data)) + data

    def answers(choices: list[str], labels: list[int]) -> bytes:
        return (struct.pack("<I", len(choices)) + b"".join(map(string, choices)) +
                struct.pack(f"<{len(labels)}i", *labels))

    tasks = []
    for k in range(n):
        i = 10 * k
        choices = [lines[i + 1], _garbled(lines[i + 1]), _garbled(lines[i + 2])]
        gold = k % 3
        choices[0], choices[gold] = choices[gold], choices[0]
        labels = [int(j == gold) for j in range(3)]
        tasks.append(string(lines[i]) + answers(choices, labels) + answers(choices, labels))
    offsets, at = [], 4 + 4 * n
    for task in tasks:
        offsets.append(at)
        at += len(task)
    path.write_bytes(struct.pack("<I", n) + struct.pack(f"<{n}I", *offsets) + b"".join(tasks))
    return path


SCORES = {
    "hellaswag": (_hellaswag, ["--hellaswag", "--hellaswag-tasks"]),
    "winogrande": (_winogrande, ["--winogrande", "--winogrande-tasks"]),
    "multiple-choice": (_multiple_choice, ["--multiple-choice", "--multiple-choice-tasks"]),
}
N_TASKS = 12


def _score(smollm2: Path, data: Path, flags: list[str], kv: list[str]) -> list[list[float]]:
    """The score's per-task rows, as numbers: the task, the running accuracy (%), and Winogrande's two choices'
    mean log-probabilities."""
    args = ["-m", str(smollm2), "-bf" if data.suffix == ".bin" else "-f", str(data), flags[0], flags[1],
            str(N_TASKS), "-c", "256", "-t", "2", *kv, *device.TOOL_ARGS]
    proc = subprocess.run([str(paths.tool("llama-perplexity")), *args], capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    # HellaSwag's rows end in a confidence interval ("[20.6%, 100.0%]"), Winogrande's in its choice and answer
    rows = [[float(x.rstrip("%")) for x in line.split()[:4] if "[" not in x and "]" not in x]
            for line in output.splitlines() if re.match(r"\d+\t", line)]
    assert rows and rows[-1][0] == len(rows), output[-3000:]
    return rows


F16 = ["-ctk", "f16", "-ctv", "f16", "-fa", "on"]
KIVI2 = ["-ctk", "kivi2", "-ctv", "kivi2", "-fa", "on"]  # its window holds these short tasks in fp16
KIVI_QUANTIZED = ["-ctk", "kivi4", "-ctv", "kivi1", "--kv-window", "16", "-fa", "on"]


@pytest.mark.slow
@pytest.mark.parametrize("score", ["hellaswag", "multiple-choice"])
def test_llama_perplexity_scores_multiple_choice_tasks_with_a_kivi_cache(smollm2: Path, hamlet: Path,
                                                                          tmp_path: Path, score: str) -> None:
    """HellaSwag and multiple choice run through with kivi caches (every batch failed before: the tasks' shared
    tokens) and score clear choices as f16 does."""
    write, flags = SCORES[score]
    data = write(_lines(hamlet), tmp_path / ("tasks.bin" if score == "multiple-choice" else "tasks.txt"), N_TASKS)
    f16 = _score(smollm2, data, flags, F16)[-1][1]
    assert f16 > 90.0
    for kv in (KIVI2, KIVI_QUANTIZED):
        assert _score(smollm2, data, flags, kv)[-1][1] == f16


@pytest.mark.slow
def test_llama_perplexity_winogrande_with_a_kivi_cache(smollm2: Path, hamlet: Path, tmp_path: Path) -> None:
    """Winogrande prints each task's two mean log-probabilities: kivi2, whose window holds these tasks, gives f16's
    within what upstream's two attention paths over the same f16 cache differ by (a logit read from another token
    moves them by nats); a quantized cache runs every task through."""
    data = _winogrande(_lines(hamlet), tmp_path / "tasks.txt", N_TASKS)
    flags = SCORES["winogrande"][1]
    f16 = np.array(_score(smollm2, data, flags, F16))[:, 2:]
    upstream_noise = np.abs(np.array(_score(smollm2, data, flags, [*F16[:-1], "off"]))[:, 2:] - f16).max()
    kivi = np.array(_score(smollm2, data, flags, KIVI2))[:, 2:]
    assert np.abs(kivi - f16).max() < 3 * upstream_noise < 0.5
    assert len(_score(smollm2, data, flags, KIVI_QUANTIZED)) == len(f16)
