"""The tools pykvq drives print their final results every time.

Upstream's logger is a leaked singleton whose worker thread writes asynchronously: a fast tool could exit
before its last lines (llama-perplexity's "Final estimate") were written, and `pykvq perplexity` then failed
now and then. native/patches drains the log at exit; a tiny model makes the race as tight as it gets.
"""

from __future__ import annotations

from pathlib import Path

from pykvq import llama_tools
from pykvq.devtools import random_model

RUNS = 12


def test_perplexity_never_loses_its_final_estimate(tmp_path: Path, hamlet: Path) -> None:
    model = tmp_path / "tiny.gguf"
    random_model.write(random_model.SHAPES["tiny"], model)
    # a short text: the random model's byte tokens make hamlet's 180k characters slow to tokenize
    text = tmp_path / "text.txt"
    text.write_text(hamlet.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    args = ["-m", str(model), "-f", str(text), "-c", "128", "-b", "128", "--chunks", "1", "-t", "2"]
    missing = [i for i in range(RUNS) if "Final estimate" not in llama_tools.run_tool("llama-perplexity", args)]
    assert missing == [], f"runs {missing} of {RUNS} printed no final estimate"


def test_a_refused_argument_leads_the_tools_error(tmp_path: Path) -> None:
    """The argument parser's reason, printed before any log line, is the error's first line: `pykvq perplexity`
    showed only "exited with status 1" for a row whose flag llama-perplexity refused."""
    try:
        llama_tools.run_tool("llama-perplexity", ["-m", str(tmp_path / "unread.gguf"), "--kv-window", "2147483648"])
    except llama_tools.ToolError as err:
        first = str(err).splitlines()[0]
    else:
        raise AssertionError("llama-perplexity took a window beyond int32")
    assert first.startswith('llama-perplexity exited with status 1: error while handling argument "--kv-window"'), first
