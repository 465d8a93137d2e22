"""Prove the Colab setup cell works: course_lib installs next to an existing torch
without replacing it, and runs real ranks.

    python scripts/check_colab_install.py          # about a minute or two; prints each step's time
    python scripts/check_colab_install.py --keep   # leave the virtual environment behind

Colab comes with torch, numpy, matplotlib and ipywidgets installed, and the first cell of
every notebook (scripts/colab_cell.py) runs ``pip install git+<repository>@<branch>``. This
script rebuilds that situation from scratch, offline except for the package index:

1. a fresh virtual environment with only torch (the local CPU range, ``torch>=2.6,<2.14``),
   numpy, matplotlib and ipywidgets; torch's version is recorded;
2. the setup cell itself, executed as Colab would (``google.colab`` importable), with the
   git URL replaced by a copy of this checkout (``pip install <path>``);
3. checks: torch's version and files are unchanged, nothing CUDA-flavoured was pulled in,
   every ``course_lib`` module imports, and ``course_lib.launch`` runs an all-reduce on
   2 ranks, from a folder outside the checkout (so the installed copy is the one used).

4. every notebook (lectures, exercises, solutions) needs nothing but the installed package: no
   ``..`` path, no file beside it, no ``benchmarks``/``scripts``/``tests`` import, no
   ``sys.path`` change, no ``spec_from_file_location``/``runpy``/``%run`` (``files_outside_package``;
   Colab opens a notebook alone, without the repository around it). This step runs first.

Exits non-zero, naming the failed step, when anything is wrong.
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from colab_cell import BRANCH, COLAB_CELL, REPO_URL  # noqa: E402

TORCH_RANGE = "torch>=2.6,<2.14"  # as in requirements.txt: the local CPU build
COLAB_PREINSTALLED = [TORCH_RANGE, "numpy", "matplotlib", "ipywidgets"]
NOT_SOURCE = (".git", ".venv*", "_build", "build", "*.egg-info", "__pycache__", ".pytest_cache",
              ".ipynb_checkpoints", "notebooks", "solutions", "exercises", "benchmarks", "book")

SMOKE = textwrap.dedent('''
    import importlib, os, pkgutil, sys
    import torch, torch.distributed as dist
    import course_lib

    where = os.path.dirname(course_lib.__file__)
    assert "site-packages" in where, f"course_lib imported from {where}, not from the installed copy"
    failed = []
    for mod in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        try:
            importlib.import_module(mod.name)
        except Exception as exc:
            failed.append(f"{mod.name}: {type(exc).__name__}: {exc}")
    assert not failed, "modules that do not import with only the Colab packages:\\n  " + "\\n  ".join(failed)

    def all_reduce_ranks(scale):
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)                      # 1 + 2
        return dist.get_rank(), float(t) * scale

    results = course_lib.launch(all_reduce_ranks, 2, 10.0)
    assert list(results) == [(0, 30.0), (1, 30.0)], list(results)
    print(f"course_lib {course_lib.__version__} from {where}: launch on 2 ranks -> {list(results)}")
''')


NOTEBOOK_FOLDERS = ("notebooks", "exercises", "solutions")
REPOSITORY_ONLY = {"benchmarks", "scripts", "tests", "solutions", "exercises", "notebooks", "book"}
LOADERS = {"spec_from_file_location", "run_path", "run_module", "chdir"}
DATA_FILE = re.compile(r"[\w./-]+\.(py|ipynb|csv|json|txt|pt|pth|npy|npz|bin|pkl|yaml|yml|cfg|md)")


def files_outside_package(path: str) -> list[str]:
    """Why notebook ``path`` would fail in Colab, where it is opened alone and only ``course_lib``
    is installed: each place its code reaches for a file of the repository ("cell 43: ...");
    empty when it needs nothing but the package."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    folder, found = os.path.dirname(os.path.abspath(path)), []
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        lines = source.splitlines()
        found += [f"cell {index}: runs a file ({line.strip()!r})" for line in lines if line.strip().startswith("%run")]
        python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
        try:
            tree = ast.parse(python)
        except SyntaxError as exc:
            found.append(f"cell {index}: does not parse ({exc.msg})")
            continue
        in_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value      # (an f-string's literal ".." after a field is text, not a path)
                if (text == ".." and id(node) not in in_fstring) or text.startswith(("../", "..\\")) or "/../" in text:
                    found.append(f"cell {index}: a path above the notebook ({text!r})")
                elif DATA_FILE.fullmatch(text) and os.path.exists(os.path.join(folder, text)):
                    found.append(f"cell {index}: reads a file beside the notebook ({text!r})")
            elif isinstance(node, ast.Attribute) and node.attr in LOADERS:
                found.append(f"cell {index}: loads code or changes folder by path ({node.attr})")
            elif (isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend")
                  and isinstance(node.value, ast.Attribute) and node.value.attr == "path"):
                found.append(f"cell {index}: changes sys.path")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"cell {index}: imports {name!r}, which is not in the package" for name in names
                          if name.split(".")[0] in REPOSITORY_ONLY]
    return found


def notebooks_outside_package(root: str = ROOT) -> dict:
    """{notebook: problems} for every notebook of the course that reaches outside the package."""
    paths = sorted(p for folder in NOTEBOOK_FOLDERS for p in glob.glob(os.path.join(root, folder, "*.ipynb")))
    return {os.path.relpath(p, root): problems for p in paths if (problems := files_outside_package(p))}


class Step:
    def __init__(self, name, detail=""):
        self.name = name
        self.detail = detail

    def __enter__(self):
        print(f"--- {self.name}" + (f": {self.detail}" if self.detail else ""), flush=True)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        print(f"    {'failed' if exc[0] else 'done'} in {self.seconds:.1f} s", flush=True)
        TIMES.append((self.name, self.seconds))
        return False


TIMES: list = []


def run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kw)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed (exit {result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-4000:]}")
    return result.stdout


def torch_state(python):
    out = run([python, "-c", "import torch, os; print(torch.__version__); print(os.path.dirname(torch.__file__))"])
    version, location = out.split()[:2]
    return version, location


def freeze(python):
    lines = run([python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"]).splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the temporary virtual environment")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="colab_check_")
    venv = os.path.join(work, "venv")
    python = os.path.join(venv, "bin", "python")
    started = time.perf_counter()
    try:
        with Step("notebooks", "every notebook needs only the installed course_lib (no repository files)"):
            outside = notebooks_outside_package()
            if outside:
                raise RuntimeError("notebooks that read files outside the package (they fail in Colab):\n  "
                                   + "\n  ".join(f"{nb}: {p}" for nb, problems in outside.items() for p in problems))
        with Step("venv", "a fresh virtual environment"):
            run([sys.executable, "-m", "venv", venv])
        with Step("preinstall", "Colab's packages: " + ", ".join(COLAB_PREINSTALLED)):
            run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *COLAB_PREINSTALLED])
            torch_before = torch_state(python)
            packages_before = freeze(python)
            print(f"    torch {torch_before[0]} at {torch_before[1]}")
        with Step("setup cell", "as Colab runs it, the git URL replaced by a copy of this checkout"):
            source = os.path.join(work, "course")
            shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
            url = f"git+{REPO_URL}@{BRANCH}"
            assert url in COLAB_CELL, f"the setup cell does not install {url}"
            cell = COLAB_CELL.replace(url, source)
            runner = ("import sys, types\n"
                      "sys.modules['google.colab'] = types.ModuleType('google.colab')  # what Colab has\n"
                      + cell + "\n")
            run([python, "-c", runner], cwd=work)
        with Step("torch kept", "torch unchanged, nothing CUDA pulled in"):
            torch_after = torch_state(python)
            packages_after = freeze(python)
            added = sorted(set(packages_after) - set(packages_before))
            changed = sorted(p for p in packages_before if packages_after.get(p) != packages_before[p])
            print(f"    added: {', '.join(f'{p}=={packages_after[p]}' for p in added) or 'nothing'}")
            if torch_after != torch_before:
                raise RuntimeError(f"installing course_lib replaced torch {torch_before} with {torch_after}")
            if changed:
                raise RuntimeError(f"installing course_lib changed preinstalled packages: {changed}")
            cuda = [p for p in added if p.lower().startswith(("nvidia-", "triton"))]
            if cuda:
                raise RuntimeError(f"installing course_lib pulled CUDA packages: {cuda}")
        with Step("launch", "import every course_lib module; launch on 2 ranks (cwd outside the checkout)"):
            print("    " + run([python, "-c", SMOKE], cwd=work, timeout=300).strip())
        total = time.perf_counter() - started
        print(f"OK: the Colab setup cell installs course_lib and keeps torch {torch_before[0]} "
              f"({total:.0f} s: " + ", ".join(f"{n} {t:.0f} s" for n, t in TIMES) + ")")
        return 0
    except Exception as exc:  # noqa: BLE001 - report the failed step, exit non-zero
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {venv}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
