"""Committed outputs must not depend on the CPU that executed the notebook.

Matmul and reduction kernels differ between CPUs (AVX-512 vs AVX2, Intel vs AMD, MKL's code
paths), and a training loss after many steps differs in its last digits between them. The rule
(CONTRIBUTING.md, "Portable outputs"): checked cells print only exact things, or claims through
a check with a stated tolerance; raw kernel-dependent numbers go to `# NBVAL_IGNORE_OUTPUT`
cells. This test re-runs a training notebook under strict nbval with ATen's kernels forced to
another instruction set than this machine's (``ATEN_CPU_CAPABILITY``), as a learner's CPU
would, so a checked cell that prints a kernel-dependent number fails here, not on their machine.

One notebook, one capability: chapter 0 trains for 200 steps (the most sensitive output of the
course) in about a minute; "default" (no vector kernels) differs from every x86 machine's own.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_nbval

NOTEBOOKS = ["notebooks/00_single_device.ipynb"]
CAPABILITIES = ["default"]


def capability_under(value: str) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_reproduces_its_outputs_on_other_cpu_kernels(path, capability):
    native = capability_under("")
    forced = capability_under(capability)
    if forced == native:
        pytest.skip(f"this machine's own kernels are already {native!r}")
    assert forced.lower() == capability.lower(), f"ATEN_CPU_CAPABILITY={capability} gave {forced}"
    result = run_nbval(path, "strict", env={"ATEN_CPU_CAPABILITY": capability})
    assert result.returncode == 0, (
        f"pytest --nbval {path} with ATEN_CPU_CAPABILITY={capability} (this machine: {native}) failed: a "
        f"checked cell prints a number that depends on the CPU's kernels. Print it in a "
        f"'# NBVAL_IGNORE_OUTPUT' cell and check the claim with a stated tolerance (CONTRIBUTING.md):\n"
        + result.log[-8000:])
