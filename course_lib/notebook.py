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
