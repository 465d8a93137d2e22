"""The ranks' code names a device for every tensor it creates: NCCL sends CUDA tensors only.

On one H100 (2026-11-27) the training example under ``--backend nccl`` died at FSDP's first
all-gather: "No backend type associated with device type cpu". Its tensors were on the CPU.
A CPU tensor handed to an NCCL group fails only on a GPU, and CI has none: so the code that
runs on ranks (collectives, parallel wrappers, debugging, precision, the virtual clock) is read
here, and every tensor factory in it must name its ``device``: the data's (``device=x.device``,
or ``x.new_empty``), or the one the group's backend sends (``compat.backend_device(group)``:
the rank's GPU under NCCL, the CPU under gloo), or ``"cpu"`` where the tensor never travels.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1] / "course_lib"
RANK_CODE = ["collectives", "debug", "parallel", "precision", "virtual/clock.py", "compat.py"]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint",
             "linspace", "eye", "empty_strided"}


def _files():
    for entry in RANK_CODE:
        path = ROOT / entry
        yield from (sorted(path.rglob("*.py")) if path.is_dir() else [path])


def factories_without_a_device(source: str):
    """Line numbers of ``torch.<factory>(...)`` calls with no ``device=`` keyword."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch" and not any(k.arg == "device" for k in node.keywords)):
            yield node.lineno, node.func.attr


def test_rank_code_names_the_device_of_every_tensor_it_creates():
    found = [f"{path.relative_to(ROOT.parent)}:{line}: torch.{name}(...)"
             for path in _files() for line, name in factories_without_a_device(path.read_text())]
    assert not found, ("tensors created without a device (an NCCL group refuses CPU tensors; name "
                       "device=x.device, compat.backend_device(group), or \"cpu\" if it never "
                       "travels):\n" + "\n".join(found))


def test_the_reader_catches_what_it_should():
    source = ("import torch\n"
              "a = torch.zeros(3)\n"                                       # caught
              "b = torch.zeros(3, device=x.device)\n"
              "c = x.new_empty(3)\n"
              "d = torch.tensor([1], dtype=torch.int64)\n"                 # caught
              "e = torch.cat([a, b])\n")
    assert [line for line, _ in factories_without_a_device(source)] == [2, 5]
    assert len(list(_files())) > 30


def test_backend_device_follows_the_group_backend(monkeypatch):
    """gloo's groups get CPU tensors, NCCL's the rank's current GPU."""
    import torch.distributed as dist

    from course_lib import compat

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert compat.backend_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert compat.backend_device() == torch.device("cuda", 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_course_collectives_and_checks_under_nccl():
    """One rank under NCCL: the course's validated ring, the desync check, the overflow vote
    and a pipeline's shape header all travel on the GPU."""
    from course_lib.launch import launch

    def on_gpu():
        from course_lib import collectives as C
        from course_lib.collectives.comm import Comm
        from course_lib.debug import desync
        from course_lib.precision.loss_scale import overflow_on_any_rank

        x = torch.arange(8.0, device="cuda")
        C.all_reduce(x)
        desync.check(Comm(None), "all_reduce", [x], "", "test")
        return x.sum().item(), overflow_on_any_rank([x], Comm(None))

    assert launch(on_gpu, 1, backend="nccl", quiet=True)[0] == (28.0, False)


def _send_off_the_cpu():
    from course_lib.collectives.comm import Comm

    comm = Comm(None)
    comm.isend(torch.empty(4, device="meta"), (comm.rank + 1) % comm.size)   # not a CPU tensor


def test_gloo_point_to_point_refuses_tensors_off_the_cpu_by_name():
    """On the H100, gloo's all-reduce, broadcast, all-gather, reduce-scatter and all-to-all took
    CUDA tensors; its send died with "writev ...: Bad address" and left the peer waiting. The
    communication layer refuses such a send (or receive) before anything moves."""
    from course_lib.launch import RankError, launch

    with pytest.raises(RankError, match="point-to-point over gloo: gloo sends and receives CPU tensors only"):
        launch(_send_off_the_cpu, 2, quiet=True, timeout=30)
