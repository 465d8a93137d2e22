"""Committed outputs must not depend on the CPU that executed the notebook.

Matmul and reduction kernels differ between CPUs (AVX-512 vs AVX2, Intel vs AMD, MKL's code
paths), and a training loss after many steps differs in its last digits between them. The rule
(CONTRIBUTING.md, "Portable outputs"): checked cells print only exact things, or claims through
a check with a stated tolerance; raw kernel-dependent numbers go to `# NBVAL_IGNORE_OUTPUT`
cells. The strict nbval runs of the training chapters (0 and 3-8; chapter 0's 200 training
steps are the most sensitive output of the course) use ATen's portable "default" kernels instead of this machine's own
(``conftest.OTHER_KERNELS``), as a learner's CPU would, so a checked cell that prints a
kernel-dependent number fails in CI, not on a learner's machine. The same run serves
tests/test_notebooks.py: no notebook is run twice.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import OTHER_KERNELS, nbval_strict


def capability_under(env: dict) -> str:
    """The kernels torch picks in a fresh process with ``env`` added to the environment."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("path", sorted(OTHER_KERNELS))
def test_notebook_reproduces_its_outputs_on_other_cpu_kernels(path):
    env = OTHER_KERNELS[path]
    native, forced = capability_under({"ATEN_CPU_CAPABILITY": ""}), capability_under(env)
    assert forced.lower() == env["ATEN_CPU_CAPABILITY"].lower(), f"{env} gave {forced}"
    if forced == native:
        pytest.skip(f"this machine's own kernels are already {native!r}")
    result = nbval_strict(path)
    assert result.returncode == 0, (
        f"pytest --nbval {path} with {env} (this machine's own kernels: {native}) failed. If a cell "
        f"printing a kernel-dependent number differs (training losses, generated text, max |diff|), print "
        f"it in a '# NBVAL_IGNORE_OUTPUT' cell and check the claim with a stated tolerance "
        f"(CONTRIBUTING.md); other differences mean the notebook needs re-executing:\n" + result.log[-8000:])
