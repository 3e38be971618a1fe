"""Argument types the pykvq commands share: their values as llama.cpp's tools spell them."""

from __future__ import annotations

import argparse

from pykvq import kv_types


def switch(text: str) -> bool:
    """on/off, as llama.cpp's boolean flags take it."""
    if text in ("on", "1", "true", "yes"):
        return True
    if text in ("off", "0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def rotation(text: str) -> str:
    """--kv-rotate as the C API's rotation spec: on/off for every kivi layer (any of the switch's words), or a
    per-layer spec (checked where the cache takes it)."""
    try:
        return "on" if switch(text) else "off"
    except argparse.ArgumentTypeError:
        if ":" not in text:
            raise argparse.ArgumentTypeError(f"expected on, off or a per-layer spec such as 'k:*=on;v:0-3=off,4-=on', "
                                             f"got {text!r}") from None
        return text


def selection(text: str) -> kv_types.Selection:
    """--kv-select's HH,RW[,N[,D]]."""
    try:
        return kv_types.parse_select(text)
    except kv_types.KvTypeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
