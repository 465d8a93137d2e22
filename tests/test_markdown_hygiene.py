r"""No ASCII control character (other than a newline) in the book's markdown: every markdown
cell of every notebook in notebooks/, solutions/ and exercises/, and the pages in book/.

A Python string written without r"" turns LaTeX into control characters: "\approx" holds a
BEL (\a) and "\text" a TAB (\t), and the page renders "pprox" and "ext{error}" (chapter 9c
did). A TAB, a carriage return or a form feed is as invisible in the source, so all of them
fail; the message names the cell, the line and the character.
"""
from __future__ import annotations

import glob
import os

import nbformat
import pytest

from conftest import ROOT, notebooks_in

FOLDERS = ("notebooks", "solutions", "exercises")
CONTROL = {chr(c) for c in range(32) if chr(c) != "\n"} | {"\x7f"}


def control_characters(text: str) -> list[tuple[int, int, str, str]]:
    """(line, column, character as repr, the line around it) for each control character
    in ``text`` other than a newline, lines and columns counted from 1."""
    found = []
    for n, line in enumerate(text.split("\n"), 1):
        for col, ch in enumerate(line, 1):
            if ch in CONTROL:
                found.append((n, col, repr(ch), line[max(0, col - 30):col + 30]))
    return found


def _markdown_pages() -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "book", "*.md")))


def test_the_check_sees_latex_written_without_a_raw_string():
    found = control_characters("$2^{-9} \approx 0.002$\n$|\text{error}|$")
    assert [(line, ch) for line, _, ch, _ in found] == [(1, "'\\x07'"), (2, "'\\t'")]
    assert control_characters("a\nb $\\approx$ \\text{x}\n") == []


@pytest.mark.parametrize("path", [p for folder in FOLDERS for p in notebooks_in(folder)])
def test_markdown_cells_have_no_control_characters(path):
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    bad = [f"cell {i}, line {line}, column {col}: {ch} in ...{around!r}..."
           for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
           for line, col, ch, around in control_characters(cell.source)]
    assert not bad, (f"{path}: control characters in markdown (LaTeX written in a Python "
                     f"string without r''? a TAB?):\n" + "\n".join(bad))


@pytest.mark.parametrize("path", _markdown_pages())
def test_book_pages_have_no_control_characters(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        bad = [f"line {line}, column {col}: {ch} in ...{around!r}..."
               for line, col, ch, around in control_characters(f.read())]
    assert not bad, f"{path}: control characters:\n" + "\n".join(bad)
