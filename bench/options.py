"""Command-line values the benches share, checked where argparse reads them."""

from __future__ import annotations

import argparse
import re


def study_name(text: str) -> str:
    """--study NAME: it names a record's file."""
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: lower-case letters, digits and single hyphens (it names a file)")
    return text


def sink_count(text: str) -> int:
    """--kv-sinks N: a count of the kivi types' fp16 sinks."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: a count of 0 or more")
    return n
