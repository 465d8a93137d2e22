"""The rendered book: _toc.yml matches the notebooks, the Colab buttons point at the
repository the setup cell installs from, the bibliography is complete, and
`jupyter-book build . --all -W --keep-going` passes with zero warnings, while a committed
notebook with an error output or an incomplete run fails it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
import yaml

from conftest import ROOT, WITHOUT_IRI, notebooks_in

sys.path.insert(0, os.path.join(ROOT, "book", "_ext"))
import notebook_checks  # noqa: E402

from colab_cell import BRANCH, COLAB_CELL, REPO_URL  # noqa: E402

BUILD_TIMEOUT = 600


def load_yaml(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return yaml.safe_load(f)


def toc_files(toc) -> list[str]:
    """Every document of _toc.yml (root included), as written there (no extension)."""
    found = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                found.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk({k: v for k, v in toc.items() if k != "root"})
    return found


def _stem(path: str) -> str:
    return os.path.splitext(path)[0]


def test_every_toc_entry_exists():
    missing = [f for f in toc_files(load_yaml("_toc.yml"))
               if not any(os.path.exists(os.path.join(ROOT, _stem(f) + ext)) for ext in (".md", ".ipynb"))]
    assert not missing, f"_toc.yml lists documents that do not exist: {missing}"


@pytest.mark.parametrize("folder", ["notebooks", "exercises"])
def test_every_notebook_is_in_the_toc(folder):
    listed = {_stem(f) for f in toc_files(load_yaml("_toc.yml"))}
    absent = [p for p in notebooks_in(folder) if _stem(p) not in listed]
    assert not absent, ("only_build_toc_files is on, so these notebooks would silently be left out "
                        "of the book; add them to _toc.yml: "
                        + ", ".join(f"- file: {_stem(p)}" for p in absent))


@pytest.mark.parametrize("path", notebooks_in("notebooks") + notebooks_in("exercises"))
def test_every_notebook_page_has_one_title(path):
    """The first heading is the page's title in the book's sidebar: one '# Title', first."""
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    headings = [line for cell in nb.cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if re.match(r"^#{1,6} ", line)]
    titles = [h for h in headings if h.startswith("# ")]
    assert headings and headings[0].startswith("# ") and len(titles) == 1, (
        f"{path}: needs exactly one '# Title' heading, before any '## Section' "
        f"(found first {headings[:1]}, titles {titles}); the book would title the page with its first heading")


def test_solutions_are_not_published():
    toc = toc_files(load_yaml("_toc.yml"))
    assert not [f for f in toc if f.startswith("solutions/")]
    assert "solutions" in load_yaml("_config.yml")["exclude_patterns"]


def test_launch_buttons_open_the_repository_the_setup_cell_installs():
    config = load_yaml("_config.yml")
    assert config["repository"]["url"] == REPO_URL
    assert config["repository"]["branch"] == BRANCH
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert f"git+{REPO_URL}@{BRANCH}" in COLAB_CELL
    with open(os.path.join(ROOT, "book", "how_to_run.md"), encoding="utf-8") as f:
        assert f"git+{REPO_URL}@{BRANCH}" in f.read(), "book/how_to_run.md shows a stale setup cell"


def test_execution_is_off_and_strict():
    execute = load_yaml("_config.yml")["execute"]
    assert execute["execute_notebooks"] == "off"  # see the comment in _config.yml
    assert execute["raise_on_error"] is True and execute["allow_errors"] is False
    assert execute["timeout"] >= 120


# ----------------------------------------------------------------------------- bibliography

REQUIRED_KEYS = [
    "rajbhandari2020zero", "shoeybi2019megatron", "narayanan2021megatron", "korthikanti2022reducing",
    "huang2019gpipe", "narayanan2019pipedream", "liu2023ring", "grattafiori2024llama3",
    "gibiansky2017baidu", "patarasuk2009bandwidth", "thakur2005mpich", "zhao2023fsdp", "li2020ddp",
    "kaplan2020scaling", "hoffmann2022chinchilla", "fedus2022switch", "lepikhin2021gshard",
    "jacobs2023ulysses", "qi2024zerobubble",
]


def bib_entries() -> dict:
    with open(os.path.join(ROOT, "book", "references.bib"), encoding="utf-8") as f:
        text = f.read()
    entries = {}
    for m in re.finditer(r"^@(\w+)\{([^,]+),(.*?)^\}", text, re.S | re.M):
        kind, key, body = m.group(1).lower(), m.group(2).strip(), m.group(3)
        assert key not in entries, f"duplicate bibliography key {key}"
        fields = dict(re.findall(r"^\s*(\w+)\s*=\s*\{(.*)\},?\s*$", body, re.M))
        entries[key] = (kind, fields)
    return entries


def test_bibliography_has_the_course_papers():
    entries = bib_entries()
    assert not [k for k in REQUIRED_KEYS if k not in entries]
    for key, (kind, fields) in entries.items():
        for needed in ("title", "author"):
            assert fields.get(needed), f"{key}: no {needed}"
        assert fields.get("year") or kind == "misc", f"{key}: no year"
        assert fields.get("url") or fields.get("doi"), f"{key}: give a url or doi so a reader can find it"
        year = re.search(r"(19|20)\d\d", key)
        if year and fields.get("year"):
            assert year.group(0) == fields["year"], f"{key}: key says {year.group(0)}, year is {fields['year']}"


def cited_keys() -> dict:
    """{key: [where]} for every {cite} role in book/*.md and in notebooks' markdown cells."""
    cites = {}
    role = re.compile(r"\{cite(?::\w+)?\}`([^`]+)`")

    def scan(text, where):
        for m in role.finditer(text):
            for key in m.group(1).split(","):
                cites.setdefault(key.strip(), []).append(where)

    for name in sorted(os.listdir(os.path.join(ROOT, "book"))):
        if name.endswith(".md"):
            with open(os.path.join(ROOT, "book", name), encoding="utf-8") as f:
                scan(f.read(), f"book/{name}")
    for path in notebooks_in("notebooks") + notebooks_in("exercises"):
        nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                scan(cell.source, path)
    return cites


def test_every_citation_is_in_the_bibliography():
    entries = bib_entries()
    unknown = {k: v for k, v in cited_keys().items() if k not in entries}
    assert not unknown, f"cited keys missing from book/references.bib: {unknown}"


# ----------------------------------------------------------------------------- the build

def build(source: str, out: str) -> subprocess.CompletedProcess:
    """``jupyter-book build`` (its console script's main) in this Python, with jsonschema's IRI
    checker marked absent (conftest.WITHOUT_IRI: the build reads every notebook with nbformat)."""
    jb = shutil.which("jupyter-book", path=os.path.dirname(sys.executable)) or shutil.which("jupyter-book")
    assert jb, "jupyter-book is not installed (pip install -r requirements.txt)"
    main = WITHOUT_IRI + "from jupyter_book.cli.main import main; sys.argv[0] = 'jupyter-book'; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", main, "build", source, "--all", "-W", "--keep-going",
                           "--path-output", out],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT, stdin=subprocess.DEVNULL)


def test_book_builds_without_warnings(tmp_path):
    result = build(ROOT, str(tmp_path))
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "WARNING" not in log, log[-6000:]
    html = tmp_path / "_build" / "html"
    assert (html / "index.html").exists()
    assert_maths_offline(html / "notebooks" / "05_tensor_parallel.html")
    owner_repo = REPO_URL.split("github.com/")[1]
    for path in notebooks_in("notebooks") + notebooks_in("exercises"):  # each page opens in Colab
        page = (html / _stem(path)).with_suffix(".html")
        if page.exists():  # (a notebook missing from _toc.yml fails test_every_notebook_is_in_the_toc)
            assert f"https://colab.research.google.com/github/{owner_repo}/blob/{BRANCH}/{path}" \
                in page.read_text(encoding="utf-8"), f"{page} has no Colab launch button"


def _notebook(cells, executed=True):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells.append(nbformat.v4.new_markdown_cell("# A page"))
    for i, (source, outputs) in enumerate(cells, 1):
        cell = nbformat.v4.new_code_cell(source, execution_count=i if executed else None)
        cell.outputs = outputs
        nb.cells.append(cell)
    return nb


def _stdout(text):
    return [nbformat.v4.new_output("stream", name="stdout", text=text)]


def _error(ename, evalue):
    return [nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])]


def test_problems_spots_errors_and_incomplete_runs():
    good = _notebook([("print(1)", _stdout("1\n")), ("x = 2", [])])
    assert notebook_checks.problems(good, require_executed=True) == []
    failed = _notebook([("print(1)", _stdout("1\n")), ("1/0", _error("ZeroDivisionError", "division by zero"))])
    assert "ZeroDivisionError" in notebook_checks.problems(failed, require_executed=False)[0]
    lesson = _notebook([("# NBVAL_RAISES_EXCEPTION\n1/0", _error("ZeroDivisionError", "division by zero"))])
    assert notebook_checks.problems(lesson, require_executed=True) == []
    unexecuted = _notebook([("print(1)", [])], executed=False)
    assert "never executed" in notebook_checks.problems(unexecuted, require_executed=True)[0]
    assert notebook_checks.problems(unexecuted, require_executed=False) == []  # exercises: cleared on purpose
    by_hand = _notebook([("a = 1", []), ("b = 2", [])])
    by_hand.cells[2].execution_count = 1
    assert "not run once, top to bottom" in notebook_checks.problems(by_hand, require_executed=True)[0]


def _small_book(root, notebooks) -> str:
    """A book with the real _config.yml, book/ (bibliography, extension) and the given notebooks."""
    src = root / "src"
    src.mkdir()
    shutil.copy(os.path.join(ROOT, "_config.yml"), src)
    shutil.copytree(os.path.join(ROOT, "book"), src / "book")
    (src / "start.md").write_text("# A small book\n\nSee {cite}`rajbhandari2020zero` on $t$ ranks.\n")
    (src / "notebooks").mkdir()
    for name, nb in notebooks.items():
        nbformat.write(nb, src / "notebooks" / f"{name}.ipynb")
    (src / "_toc.yml").write_text("format: jb-book\nroot: start\nchapters:\n  - file: book/references\n"
                                  + "".join(f"  - file: notebooks/{name}\n" for name in notebooks))
    return str(src)


def assert_maths_offline(page):
    """A page with maths loads MathJax from the build itself (book/_ext/offline_mathjax.py), so the
    book reads without the internet: a relative script path to a file that was copied there."""
    html = page.read_text(encoding="utf-8")
    scripts = re.findall(r'<script[^>]*src="([^"]*(?:mathjax|MathJax)[^"]*)"', html)
    assert scripts, f"{page.name} loads no MathJax, though it has maths"
    for src in scripts:
        assert "://" not in src and not src.startswith("//"), f"{page.name} loads MathJax from the internet: {src}"
        local = page.parent / src.split("?")[0]
        assert local.is_file(), f"{page.name} loads {src}, which the build does not contain"
        assert (local.parent / "output" / "chtml" / "fonts" / "woff-v2").is_dir(), "MathJax's fonts are not in the build"


def test_a_committed_failure_fails_the_build(tmp_path):
    """The real configuration fails on a notebook with a stored traceback and on one whose run
    stopped half-way (the later cells never ran), with one warning each: the good notebook, the
    page with maths and a citation beside them build cleanly in the same (one) build, and the
    page loads its maths offline. (The whole book builds with no warning: test_book_builds_...)"""
    good = _notebook([("print('hello')", _stdout("hello\n"))])
    error_output = _notebook([("print('a')", _stdout("a\n")), ("1/0", _error("ZeroDivisionError", "division by zero"))])
    stopped = _notebook([("print('a')", _stdout("a\n")), ("print('b')", [])])
    stopped.cells[2].execution_count = None
    (tmp_path / "bad").mkdir()
    src = _small_book(tmp_path / "bad", {"good": good, "error_output": error_output, "stopped": stopped})
    result = build(src, str(tmp_path / "bad" / "out"))
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-4000:]
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert len(warnings) == 2, warnings
    assert any("error_output" in w and "ZeroDivisionError" in w for w in warnings), warnings
    assert any("stopped" in w and "never executed" in w for w in warnings), warnings
    assert_maths_offline(tmp_path / "bad" / "out" / "_build" / "html" / "start.html")
    assert (tmp_path / "bad" / "out" / "_build" / "html" / "notebooks" / "good.html").is_file()
    assert_outputs_wrap(tmp_path / "bad" / "out" / "_build" / "html" / "notebooks" / "good.html")


def assert_outputs_wrap(page):
    """The page loads book/_static/course.css (registered in _config.yml), whose rule wraps printed
    outputs: its selector matches the markup myst-nb gives an output (a line wider than the
    column's ~77 characters then wraps instead of hiding behind a scrollbar; code keeps scrolling)."""
    html = page.read_text(encoding="utf-8")
    links = re.findall(r'<link[^>]*href="([^"]*course\.css)[^"]*"', html)
    assert links, f"{page.name} does not load course.css"
    assert (page.parent / links[0]).is_file(), f"{links[0]} is not in the build"
    css = (page.parent / links[0]).read_text(encoding="utf-8")
    assert "div.cell_output div.output div.highlight pre" in css and "pre-wrap" in css, css
    assert re.search(r'<div class="cell_output[^"]*">\s*<div class="output stream[^"]*">\s*<div class="highlight">'
                     r'\s*<pre>', html), "myst-nb's output markup changed: update book/_static/course.css"


# ----------------------------------------------------------------------------- exercises linked

# Lecture notebooks whose summary does not link its exercise page yet (issue #22: others' files);
# remove a name once its notebook links the page (test_unlinked_list_is_current says when).
EXERCISES_NOT_LINKED_YET: set = set()   # every lecture links its exercise page


def _markdown(path) -> str:
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    return "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")


def _exercise_page(path):
    """exercises/NN_..._exercises.ipynb of lecture notebook ``path``, or None."""
    number = os.path.basename(path).split("_")[0]     # "09b", not "09": chapters 9, 9b, 9c
    pages = [p for p in notebooks_in("exercises") if os.path.basename(p).startswith(number + "_")]
    return pages[0] if pages else None


def _links_its_exercises(path) -> bool:
    return f"](../{_exercise_page(path)})" in _markdown(path)


@pytest.mark.parametrize("path", notebooks_in("notebooks"))
def test_lectures_link_their_exercise_page_not_the_solutions(path):
    assert "solutions/" not in _markdown(path), f"{path} sends the reader to the solutions: link exercises/"
    if _exercise_page(path) and path not in EXERCISES_NOT_LINKED_YET:
        assert _links_its_exercises(path), (f"{path}: link the exercise page as Markdown, e.g. "
                                            f"[{_exercise_page(path)}](../{_exercise_page(path)})")


def test_unlinked_list_is_current():
    linked = sorted(p for p in EXERCISES_NOT_LINKED_YET if _links_its_exercises(p))
    assert not linked, f"these notebooks link their exercises now: remove them from EXERCISES_NOT_LINKED_YET: {linked}"
