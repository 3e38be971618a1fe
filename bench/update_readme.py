"""Write the tables of bench/readme_tables.py between the README's results markers."""

from __future__ import annotations

import argparse
from pathlib import Path

from readme_tables import render

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{render()}\n{END}{tail}")


if __name__ == "__main__":
    main()
