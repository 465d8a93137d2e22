"""Grade exercise notebooks: a score table of questions passed per notebook.

    python scripts/grade.py                          # every notebook in exercises/
    python scripts/grade.py submissions/             # a folder of learners' notebooks (recursive)
    python scripts/grade.py alice/01_collectives_exercises.ipynb -v
    python scripts/grade.py submissions/ --csv grades.csv

A *question* is a check cell of the solution: a code cell whose first line is
``# NBVAL_CHECK_OUTPUT``. It calls a grader that prints one stable line
(``ring_all_reduce: 8/8 cases passed``). A question passes when the learner's
re-executed cell prints exactly what the same cell of the solution printed. (For one
notebook, ``pytest --nbval-lax`` agrees: in a notebook a failed check raises, and the
exercise's last cell fails while a check cell is missing or failing.)

A question is known by its check cell's code, not by the file name: each notebook
is matched to the solution in ``--reference`` (default ``solutions/``) whose check
cells it contains (then whose text it shares), so ``carol_06_pipeline.ipynb`` is
graded as ``06_pipeline_parallel_exercises.ipynb``. The expected lines come from
the solution, never from the learner's file. A check cell whose code was edited,
replaced (``print("one_f_one_b: 6/6 cases passed")``) or deleted scores 0 and is
flagged EDITED; before each check the grader modules are imported afresh, so a
learner's cell that redefined a check function changes nothing.

Each notebook runs top to bottom in a fresh kernel of this Python environment,
in its own folder, continuing past errors; a cell has ``--timeout`` seconds.
The graders themselves never hang or raise on a learner's bug.

What the learner's code may not reach: IPython's input machinery. A notebook whose cells
name it (``get_ipython``, input or AST transformers, events, custom exception handlers)
scores 0, and so does one whose kernel, probed after every cell without passing through
the input transformers (``user_expressions``), shows a hook the kernel did not start with
(a transformer, an event callback, a custom exception handler, a replaced ``sys.stdout``).
The grader's own code is pinned in the kernel and in the ranks (course_lib.grading.integrity).

A notebook that carries the solution's ``### BEGIN SOLUTION`` markers or its stored pass
lines is flagged COPY? for the instructor (its score stands: the answers are still run).

Exit status: 0 when every question of every notebook passed, 1 otherwise,
2 when there was nothing to grade.
"""
from __future__ import annotations

import argparse
import copy
import csv
import glob
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
# What nbval leaves out of the comparison (plus images, which it skips without nbdime).
SKIP_MIME = {"image/png", "image/jpeg", "application/vnd.jupyter.widget-view+json"}


@dataclass
class Question:
    name: str
    passed: bool
    got: str  # first line the learner's run printed, or what went wrong
    flagged: bool | str = False  # True: its check cell was edited, replaced or deleted; "IPYTHON": see the note


@dataclass
class NotebookGrade:
    path: str
    questions: list = field(default_factory=list)
    error: str = ""  # the notebook could not be run at all (bad JSON, dead kernel, ...)
    note: str = ""
    copied: str = ""  # why it looks like a copy of the solution (for the instructor), or ""
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(q.passed for q in self.questions)

    @property
    def total(self) -> int:
        return len(self.questions)


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and cell.source.lstrip().startswith(CHECK_MARKER)


def comparable(outputs) -> dict:
    """Outputs flattened the way nbval compares them: key -> list of values, streams coalesced."""
    merged = []
    for out in outputs:
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1] = dict(merged[-1], text=merged[-1]["text"] + out["text"])
        else:
            merged.append(dict(out))
    flat = defaultdict(list)
    for out in merged:
        kind = out.get("output_type")
        if kind == "stream":
            text = out["text"] if isinstance(out["text"], str) else "".join(out["text"])
            flat[out["name"]].append(text)
        elif kind in ("execute_result", "display_data"):
            for mime, value in out.get("data", {}).items():
                if mime not in SKIP_MIME:
                    flat[mime].append(value if isinstance(value, str) else str(value))
        elif kind == "error":
            flat["error"].append(f"{out.get('ename')}: {out.get('evalue')}")
    return dict(flat)


def question_name(expected_outputs, index: int) -> str:
    text = "".join(comparable(expected_outputs).get("stdout", []))
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.split(":", 1)[0].strip() if ":" in first else f"question {index + 1}"


def _first_line(outputs) -> str:
    flat = comparable(outputs)
    if "error" in flat:
        return "error: " + flat["error"][0].splitlines()[0]
    text = "".join(flat.get("stdout", []) + flat.get("stderr", []) + flat.get("text/plain", []))
    lines = text.strip().splitlines()
    return lines[0] if lines else "(no output)"


def normalized(source: str) -> str:
    """A check cell's code as grade.py knows it: comment lines (the NBVAL marker among them),
    blank lines and trailing spaces do not count."""
    lines = [ln.rstrip() for ln in source.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#"))


@dataclass
class Reference:
    """One solution notebook: its check cells (code -> expected outputs) and its prose."""
    path: str
    checks: list  # [(normalized code, source, expected outputs)]
    imports: str  # the solution's lines that import graders (re-run fresh before each check)
    prose: set
    defs: set     # the functions and classes it asks for
    codes: set    # every code cell, normalized (a demo that calls a check is not an edited check)


_DEFINES = re.compile(r"^\s*(?:def|class)\s+(\w+)", re.M)


def defined_names(nb) -> set:
    return {m for c in nb.cells if c.cell_type == "code" for m in _DEFINES.findall(c.source)}


def load_reference(path: str) -> Reference:
    nb = nbformat.read(path, as_version=4)
    checks = [(normalized(c.source), c.source, c.outputs) for c in nb.cells if is_check_cell(c)]
    imports = []
    for cell in nb.cells:
        if cell.cell_type == "code" and not is_check_cell(cell):
            imports += [ln for ln in _statements(cell.source) if "course_lib.grading" in ln
                        and ln.lstrip().startswith(("from ", "import "))]
    prose = {c.source.strip() for c in nb.cells if c.cell_type == "markdown" and len(c.source.strip()) > 40}
    codes = {normalized(c.source) for c in nb.cells if c.cell_type == "code"}
    return Reference(path, checks, "\n".join(imports), prose, defined_names(nb), codes)


def _statements(source: str):
    """Top-level statements of a cell as source text (an import may span lines)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [ast.get_source_segment(source, node) or "" for node in tree.body]


def load_references(reference_dir: str):
    return [load_reference(p) for p in sorted(glob.glob(os.path.join(reference_dir, "*.ipynb")))]


def identify(learner, path: str, references):
    """The reference a notebook answers, known by its check cells' code (then by its prose,
    the functions it defines, its file name): a renamed submission is graded against the
    right solution."""
    codes = {normalized(c.source) for c in learner.cells if c.cell_type == "code"}
    prose = {c.source.strip() for c in learner.cells if c.cell_type == "markdown"}
    name = os.path.basename(path)
    base = re.sub(r"^Copy of ", "", re.sub(r"\s*\(\d+\)(?=\.ipynb$)", "", name))

    defs = defined_names(learner)

    def score(ref):
        return (sum(code in codes for code, _, _ in ref.checks), len(ref.prose & prose),
                len(ref.defs & defs), os.path.basename(ref.path) == base)
    best = max(references, key=score, default=None)
    return best if best is not None and any(score(best)) else None


GRADER_MODULES = ("course_lib.grading", "course_lib.launch")
# Before each check: the grader modules afresh, so a learner's cell that replaced a check
# function (or launch) by one that prints a pass line has no effect on the check.
FRESH_GRADERS = ("import sys as _sys\n"
                 "for _m in [m for m in _sys.modules if m.startswith({mods!r})]:\n"
                 "    del _sys.modules[_m]\n"
                 "{imports}\n")


def prepare(learner, reference: Reference):
    """The notebook to run and [(question, learner cell index or None, expected outputs)].

    A question is a reference check cell; the learner's notebook answers it with a cell of
    the same code. An edited, replaced or deleted check cell answers nothing: it scores 0."""
    nb = copy.deepcopy(learner)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    free = {i: normalized(c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    plan = []
    for k, (code, _, expected) in enumerate(reference.checks):
        index = next((i for i, c in sorted(free.items()) if c == code), None)
        if index is not None:
            del free[index]
        plan.append((question_name(expected, k), index, expected))
    # each check cell runs right after a fresh import of the graders (inserted cells, last first)
    fresh = FRESH_GRADERS.format(mods=GRADER_MODULES, imports=reference.imports)
    for _, index, _ in sorted((p for p in plan if p[1] is not None), key=lambda p: -p[1]):
        nb.cells.insert(index, nbformat.v4.new_code_cell(fresh))
    shift = sorted(p[1] for p in plan if p[1] is not None)
    plan = [(q, None if i is None else i + 1 + shift.index(i), e) for q, i, e in plan]
    suspicious = [i for i, code in free.items()
                  if code not in reference.codes and _looks_like_check(learner.cells[i].source)]
    return nb, plan, suspicious


def _looks_like_check(source: str) -> bool:
    return (CHECK_MARKER in source or "cases passed" in source
            or re.search(r"\bcheck(?:_\w+)?\s*\(", source) is not None)


def _question_of(source: str, reference: Reference) -> str | None:
    """The question a (changed) cell answers, by the check it calls or the question's name."""
    called = set(re.findall(r"\b(check_\w+)\s*\(", source))
    for k, (_, check_source, expected) in enumerate(reference.checks):
        name = question_name(expected, k)
        if called & set(re.findall(r"\b(check_\w+)\s*\(", check_source)) or name in source:
            return name
    return None


# What a learner's cell may not name: IPython's input machinery (a transformer can rewrite a
# check cell into a print of its pass line, a custom exception handler can hide a failure)
IPYTHON_MACHINERY = re.compile(r"get_ipython|input_transformers|ast_transformers|set_custom_exc|"
                               r"\bevents\s*\.\s*(?:register|callbacks)|InteractiveShell|"
                               r"\b_?ih\b\s*\[|run_cell")


def reaches_ipython(learner, reference: Reference) -> str:
    """'' or a note naming the first learner cell (not one of the solution's own) that names
    IPython's input machinery."""
    for i, cell in enumerate(learner.cells):
        if cell.cell_type != "code" or normalized(cell.source) in reference.codes:
            continue
        found = IPYTHON_MACHINERY.search(cell.source)
        if found:
            return (f"cell {i + 1} reaches IPython's input machinery ({found.group(0).strip()}): "
                    f"every question scores 0")
    return ""


def looks_copied(learner, reference: Reference) -> str:
    """'' or why the notebook looks like a copy of the solution: its BEGIN SOLUTION markers, or
    check cells that carry the solution's stored pass lines."""
    markers = sum("### BEGIN SOLUTION" in c.source for c in learner.cells)
    stored = {normalized(code): comparable(expected) for code, _, expected in reference.checks}
    lines = sum(1 for c in learner.cells if c.cell_type == "code" and c.get("outputs")
                and stored.get(normalized(c.source)) == comparable(c.outputs))
    why = [f"{markers} '### BEGIN SOLUTION' markers"] * bool(markers)
    why += [f"{lines} stored pass lines of the solution"] * bool(lines)
    return "COPY? " + " and ".join(why) + ": compare with the solution by hand" if why else ""


def current_env_kernel_specs():
    """A kernel spec manager that starts ipykernel with this interpreter (like nbval --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return CurrentEnv()


# The kernel's hooks on a cell's way in and out, as a sorted list of strings: evaluated as a
# user expression (after a cell, never passed through the input transformers). Hooks that
# IPython, ipykernel or matplotlib install are not listed (importing matplotlib adds some).
KNOWN_HOOKS = ("IPython", "ipykernel", "matplotlib", "matplotlib_inline", "ipywidgets", "traitlets", "comm")
PROBE = (
    "(lambda s, sys, known: sorted(set("
    "[f'{n}: {getattr(f, \"__module__\", None)}.{getattr(f, \"__qualname__\", type(f).__name__)}' "
    " for n in ('input_transformers_cleanup', 'input_transformers_post', 'ast_transformers')"
    " for f in getattr(s, n, []) if not str(getattr(f, '__module__', None)).startswith(known)]"
    "+ [f'events.{e}: {getattr(f, \"__module__\", None)}.{getattr(f, \"__qualname__\", None)}' "
    " for e, fs in s.events.callbacks.items() for f in fs"
    " if not str(getattr(f, '__module__', None)).startswith(known)]"
    "+ [f'custom_exceptions: {s.custom_exceptions!r}', f'shell: {type(s).__module__} {id(s)}']"
    "+ [f'shell.{k} replaced' for k, v in vars(s).items() if callable(v) and hasattr(type(s), k)"
    "   and not str(getattr(v, '__module__', None)).startswith(known)]"
    "+ [f'sys.{n}: {type(getattr(sys, n)).__module__}.{type(getattr(sys, n)).__qualname__}'"
    "   for n in ('stdout', 'stderr', 'displayhook', 'excepthook')])))"
    "(__import__('IPython').get_ipython(), __import__('sys'), %r)" % (KNOWN_HOOKS,))


async def _probe(client):
    """The kernel's hooks now (see PROBE), or None when the kernel did not answer."""
    import ast

    msg_id = client.kc.execute("", silent=True, store_history=False, user_expressions={"hooks": PROBE})
    reply = await client.async_wait_for_reply(msg_id)
    result = (reply or {}).get("content", {}).get("user_expressions", {}).get("hooks", {})
    if result.get("status") != "ok":
        return None
    try:
        return ast.literal_eval(result["data"]["text/plain"])
    except (KeyError, ValueError, SyntaxError):
        return None


async def _execute_probed(client, stderr):
    """Every cell in order, the kernel probed before the first and after each: returns
    (index of the first cell after which a hook appeared, what appeared) or None."""
    tampered = None
    # cleanup_kc: nbclient shuts down only the kernels it made itself; this one (made here, to
    # run this interpreter) would otherwise live, with its forkserver, until this process ends
    async with client.async_setup_kernel(stderr=stderr, cleanup_kc=True):
        baseline = await _probe(client)
        for index, cell in enumerate(client.nb.cells):
            await client.async_execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            if tampered is None and cell.cell_type == "code":
                now = await _probe(client)
                new = ["the kernel did not answer the grader's probe"] if now is None or baseline is None \
                    else sorted(set(now) - set(baseline))
                if new:
                    tampered = (index, new)
    return tampered


def execute(nb, cwd: str, timeout: int):
    """Run ``nb`` in place; returns (cell index, hooks that appeared after it) or None."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.util import run_sync

    km = KernelManager(kernel_name="python3", kernel_spec_manager=current_env_kernel_specs())
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, interrupt_on_timeout=True,
                            record_timing=False, resources={"metadata": {"path": cwd}})
    # The kernel's own stderr (ipykernel start-up notices) is noise in a score table; what
    # the cells print reaches us through the kernel's messages, not through this stream.
    client.reset_execution_trackers()
    return run_sync(_execute_probed)(client, subprocess.DEVNULL)


def grade_notebook(path: str, reference_dir: str | None = None, timeout: int = 300,
                   references=None) -> NotebookGrade:
    started = time.perf_counter()
    grade = NotebookGrade(path)
    try:
        learner = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - a broken file scores zero, the table goes on
        grade.error = f"cannot read notebook: {type(exc).__name__}: {exc}"
        return grade
    if references is None:
        references = load_references(reference_dir or os.path.join(ROOT, "solutions"))
    reference = identify(learner, path, references)
    if reference is None:
        grade.error = "not an exercise notebook of this course (no check cell or text matches a solution)"
        return grade
    if os.path.basename(reference.path) != os.path.basename(path):
        grade.note = f"graded as {os.path.basename(reference.path)}"
    nb, plan, suspicious = prepare(learner, reference)
    flags = [f"{name}: check cell edited or missing (scores 0)" for name, index, _ in plan if index is None]
    for i in suspicious:
        question = _question_of(learner.cells[i].source, reference)
        flags.append(f"{question}: cell {i + 1} looks like an edited check cell" if question
                     else f"cell {i + 1} looks like an edited check cell")
    machinery = reaches_ipython(learner, reference)
    grade.copied = looks_copied(learner, reference)
    tampered = None
    if any(index is not None for _, index, _ in plan):
        try:
            tampered = execute(nb, os.path.dirname(os.path.abspath(path)), timeout)
        except Exception as exc:  # noqa: BLE001 - dead kernel etc.: cells not run score zero
            grade.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if tampered and not machinery:
        index, new = tampered
        inserted = sum(1 for _, i, _ in plan if i is not None and i <= index)   # the fresh-import cells
        machinery = (f"after cell {index + 1 - inserted} the kernel had hooks it did not start with "
                     f"({'; '.join(new)[:160]}): every question scores 0")
    if machinery:
        flags.append(machinery)
    if flags:
        grade.note = "; ".join(([grade.note] if grade.note else []) + flags)
    for name, index, expected in plan:
        if index is None:
            grade.questions.append(Question(name, False, "check cell edited or missing", flagged=True))
            continue
        got = nb.cells[index].get("outputs", [])
        ok = bool(got) and comparable(got) == comparable(expected) and not machinery
        grade.questions.append(Question(name, ok, _first_line(got), flagged="IPYTHON" if machinery else False))
    grade.seconds = time.perf_counter() - started
    return grade


def find_notebooks(paths):
    found = []
    for p in paths:
        if os.path.isdir(p):
            found += sorted(f for f in glob.glob(os.path.join(p, "**", "*.ipynb"), recursive=True)
                            if ".ipynb_checkpoints" not in f)
        elif os.path.exists(p):
            found.append(p)
        else:
            raise FileNotFoundError(p)
    return found


def table(grades, base: str) -> str:
    rows = []
    for g in grades:
        label = os.path.relpath(g.path, base) if base else g.path
        marks = "  ".join(f"{q.name} {'ok' if q.passed else ('EDITED' if q.flagged is True else q.flagged or 'FAIL')}"
                          for q in g.questions)
        for extra in (g.error, g.note, g.copied):
            if extra:
                marks = (marks + "  " if marks else "") + f"[{extra}]"
        rows.append((label, f"{g.passed}/{g.total}", marks))
    width = max([len("notebook")] + [len(r[0]) for r in rows])
    lines = [f"{'notebook':<{width}}  score  questions", f"{'-' * width}  -----  ---------"]
    lines += [f"{label:<{width}}  {score:>5}  {marks}" for label, score, marks in rows]
    total = sum(g.total for g in grades)
    passed = sum(g.passed for g in grades)
    lines.append(f"{'total':<{width}}  {f'{passed}/{total}':>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: exercises/)")
    parser.add_argument("--reference", default=os.path.join(ROOT, "solutions"),
                        help="folder of solved notebooks with the expected check outputs (default: solutions/)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--csv", help="also write notebook,question,passed,output rows to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="print what each failed question printed")
    args = parser.parse_args(argv)
    paths = args.paths or [os.path.join(ROOT, "exercises")]
    try:
        notebooks = find_notebooks(paths)
    except FileNotFoundError as exc:
        print(f"error: no such file or folder: {exc}", file=sys.stderr)
        return 2
    if not notebooks:
        print(f"error: no notebooks under {', '.join(paths)}", file=sys.stderr)
        return 2
    base = paths[0] if len(paths) == 1 and os.path.isdir(paths[0]) else ""
    grades = []
    references = load_references(args.reference)
    for path in notebooks:
        grades.append(grade_notebook(path, args.reference, args.timeout, references))
        g = grades[-1]
        print(f"graded {path}: {g.passed}/{g.total} ({g.seconds:.0f} s)", file=sys.stderr, flush=True)
    print(table(grades, base))
    if args.verbose:
        for g in grades:
            for q in g.questions:
                if not q.passed:
                    print(f"{g.path}: {q.name}: {q.got}")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["notebook", "question", "passed", "output"])
            for g in grades:
                for q in g.questions:
                    writer.writerow([g.path, q.name, int(q.passed), q.got])
                for extra in (g.error, g.note, g.copied):
                    if extra:
                        writer.writerow([g.path, "", "", extra])
    return 0 if all(g.total and g.passed == g.total for g in grades) else 1


if __name__ == "__main__":
    sys.exit(main())
