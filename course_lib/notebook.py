"""Small helpers for lecture notebooks: show library code instead of pasting it."""
from __future__ import annotations

import inspect
import textwrap


def source(obj) -> str:
    """The source code of a function, class or module from course_lib."""
    return textwrap.dedent(inspect.getsource(obj))


def show_source(obj, lang: str = "python"):
    """Display ``obj``'s source as a highlighted code block (Markdown) in a notebook.

    The rendered book shows exactly the code the notebook runs: one source of truth.
    """
    from IPython.display import Markdown, display

    display(Markdown(f"```{lang}\n{source(obj)}```"))


def in_colab() -> bool:
    import sys

    return "google.colab" in sys.modules


# The rendered book's output box holds about 77 monospace characters at 1280 px; a wider output
# line wraps there (book/_static/course.css), and tests/test_portability.py fails on committed lines over 76.
BOOK_WIDTH = 76


def wrap_lines(text: str, width: int = BOOK_WIDTH, indent: str = "  ") -> str:
    """``text`` with every line longer than ``width`` broken at spaces; a continuation keeps the
    line's own leading spaces plus ``indent``. Short lines (tables that fit) are left alone."""
    out = []
    for line in str(text).split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip())]
        out.extend(textwrap.wrap(line.strip(), width, initial_indent=lead, subsequent_indent=lead + indent,
                                 break_on_hyphens=False, break_long_words=True))
    return "\n".join(out)


def print_wrapped(*parts, sep: str = " ", width: int = BOOK_WIDTH, indent: str = "  "):
    """``print(*parts)``, long lines wrapped to fit the book's text column (``wrap_lines``)."""
    print(wrap_lines(sep.join(str(p) for p in parts), width, indent))
