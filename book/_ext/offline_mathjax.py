"""Sphinx extension: the book's maths render offline, from a MathJax copied into the build.

Sphinx's default ``mathjax_path`` is a CDN URL, so a book read without the internet shows raw
``\\(t\\)``. requirements.txt installs ``sphinx-mathjax-offline``, a PyPI package that ships
MathJax 3 (``tex-chtml.js`` and its fonts); this extension adds that folder to
``html_static_path`` (Sphinx copies it to ``_build/html/_static/mathjax/``) and points
``mathjax_path`` at the local ``tex-chtml.js``, which every page then loads by a relative path.
A build without the package warns (an error under ``-W``) and keeps the CDN.
"""
from __future__ import annotations

import importlib.metadata
import os

from sphinx.util import logging

logger = logging.getLogger(__name__)
DISTRIBUTION = "sphinx-mathjax-offline"
ENTRY = "tex-chtml.js"  # MathJax 3's TeX input + CommonHTML output, what Sphinx loads by default


def mathjax_folder() -> str | None:
    """The installed package's folder holding ``mathjax/tex-chtml.js``, or None."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    folder = str(dist.locate_file(os.path.join(DISTRIBUTION, "static")))
    return folder if os.path.isfile(os.path.join(folder, "mathjax", ENTRY)) else None


def use_local_mathjax(app, config):
    folder = mathjax_folder()
    if folder is None:
        logger.warning(f"offline_mathjax: the package {DISTRIBUTION!r} is not installed, so the book's maths "
                       f"loads MathJax from the internet; pip install -r requirements.txt")
        return
    config.html_static_path = list(config.html_static_path) + [folder]  # -> _static/mathjax/...
    config.mathjax_path = f"mathjax/{ENTRY}"  # a relative path: Sphinx resolves it under _static/


def setup(app):
    app.connect("config-inited", use_local_mathjax)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
