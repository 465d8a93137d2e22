"""course_lib/examples/train.py runs as a real distributed script: torchrun on CPU (gloo)."""
import os
import re
import subprocess
import sys

from course_lib.launch import loopback_interface

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout=300):
    env = dict(os.environ, GLOO_SOCKET_IFNAME=loopback_interface(), OMP_NUM_THREADS="1")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchrun_four_ranks_every_strategy():
    """One torchrun start (4 processes, the costly part) trains with all four strategies."""
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                "-m", "course_lib.examples.train", "--parallel", "ddp", "zero1", "zero2", "fsdp",
                "--steps", "3", "--batch", "8"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    finals = re.findall(r"^(\w+): loss ([\d.]+) -> ([\d.]+) in 3 steps on 4 ranks$", proc.stdout, re.M)
    assert [f[0] for f in finals] == ["ddp", "zero1", "zero2", "fsdp"], proc.stdout
    # the same model, data and optimizer: the four strategies train identically (up to rounding)
    first = {round(float(f[1]), 3) for f in finals}
    last = {round(float(f[2]), 3) for f in finals}
    assert len(first) == 1 and len(last) == 1, finals
    assert float(finals[0][2]) < float(finals[0][1])


def test_bad_arguments_fail_cleanly():
    proc = run([sys.executable, "-m", "course_lib.examples.train", "--parallel", "zero3"])
    assert proc.returncode != 0 and "invalid choice" in proc.stderr
