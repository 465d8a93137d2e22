"""course_lib/examples/train.py runs as a real distributed script: torchrun on CPU (gloo)."""
import os
import re
import subprocess
import sys

import torch

from course_lib import tolerance
from course_lib.examples.train import default_microbatches
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


def test_bad_arguments_fail_cleanly(capsys):
    """(In this process: main is what ``python -m course_lib.examples.train`` runs, and a fresh
    interpreter importing torch costs ~3 s of CPU; the torchrun tests run the real script.)"""
    import pytest

    from course_lib.examples.train import main

    with pytest.raises(SystemExit) as exit_:
        main(["--parallel", "zero3"])
    assert exit_.value.code != 0 and "invalid choice" in capsys.readouterr().err


# ----------------------------------------------------------------------------- mesh mode (parallelize_nd)

TINY = ["--steps", "3", "--batch", "4", "--seq-len", "16", "--hidden", "32", "--layers", "2", "--log-every", "1"]


def single_device_losses(steps=3, batch=4, seq_len=16, hidden=32, layers=2):
    """The same model, batches and AdamW on one device (course_lib.reference.train_gpt)."""
    import torch

    from course_lib.examples.train import gpt_config, training_batches
    from course_lib.models import TinyGPT
    from course_lib.reference import train_gpt

    model = TinyGPT(gpt_config(seq_len, hidden, layers), seed=0)
    return train_gpt(model, training_batches(batch, seq_len, steps), torch.optim.AdamW(model.parameters(), lr=3e-3))[1]


def test_torchrun_eight_ranks_dp_tp_pp_equals_one_device():
    """3D (dp=2 x pp=2 x tp=2) under torchrun, 8 CPU processes: the printed losses are one device's."""
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8",
                "-m", "course_lib.examples.train", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2",
                *TINY])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"^step +\d+  loss ([\d.]+)$", proc.stdout, re.M)]
    expected = single_device_losses()
    assert len(losses) == 3, proc.stdout
    tolerance.assert_matches(losses[:1], expected[:1], dtype=torch.float32, what="first loss")
    tolerance.assert_matches(losses, expected, dtype=torch.float32, optimizer="adamw", steps=2, lr=3e-3,
                             what="losses")
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("dp=2 x pp=2 x cp=1 x tp=2: 8 ranks (ddp, 1f1b, 2 microbatches): loss "), summary
    assert summary.endswith(" in 3 steps"), summary


def test_pp_defaults_to_a_pipeline_and_reports_time_memory_and_one_device(capsys, monkeypatch):
    """--pp 2 alone: 4 micro-batches per step (each replica's batch of 4 rows, up to 4 pp); the
    step time, tokens/s, each rank's peak memory, and with --check the one-device comparison.
    (main in this process, as test_bad_arguments_fail_cleanly: outside torchrun the script's
    process prints these lines itself, and a fresh interpreter and its forkserver would import
    torch twice, ~6 s of CPU; the torchrun tests run ``python -m course_lib.examples.train``.)"""
    from course_lib.examples.train import main

    assert [default_microbatches(8, 1, 2), default_microbatches(8, 2, 2), default_microbatches(6, 1, 2),
            default_microbatches(12, 1, 4, "interleaved"), default_microbatches(8, 2, 1)] == [8, 4, 6, 12, 1]
    monkeypatch.delenv("RANK", raising=False), monkeypatch.delenv("WORLD_SIZE", raising=False)
    main(["--pp", "2", "--check", *TINY])   # (a failure raises: SystemExit or the rank's error)
    out = capsys.readouterr().out
    assert re.search(r"^step time [\d.]+ ms \(median\), [\d,]+ tokens/s$", out, re.M), out
    assert re.search(r"^peak memory per rank \(step 1, MiB\): [\d.]+ [\d.]+$", out, re.M), out
    assert re.search(r"^one device: first loss within [\d.e+-]+: True;", out, re.M), out
    assert "(ddp, 1f1b, 4 microbatches)" in out.strip().splitlines()[-1], out


def test_torchrun_layout_error_printed_once_with_status_2():
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "course_lib.examples.train", "--dp", "2", "--tp", "3", *TINY])
    assert proc.returncode != 0 and proc.stderr.count("error: the layout") == 1, proc.stderr
    assert re.search(r"rank +: 0 \(local_rank: 0\)\s+exitcode +: 2", proc.stderr), proc.stderr   # torchrun's summary


def test_bad_layout_fails_before_any_rank_starts(capsys, monkeypatch):
    """A dimension the model cannot be cut by: the constraint named, status 2, no traceback (in
    this process, as test_bad_arguments_fail_cleanly: an exception other than SystemExit(2)
    would fail here; a rank started would print its tagged lines here, or fail to launch)."""
    import pytest

    from course_lib.examples import train

    monkeypatch.delenv("RANK", raising=False), monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train, "launch", lambda *args, **kwargs: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as exit_:
        train.main(["--dp", "2", "--tp", "3", *TINY])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, out + err
    assert "n_heads=4 is not divisible by tp=3" in err and "Traceback" not in err, err
    assert "[rank" not in out  # no rank was started


def test_layout_against_torchrun_world_checked_before_the_process_group(monkeypatch, capsys):
    """Under torchrun (RANK / WORLD_SIZE set), dp*pp*cp*tp != WORLD_SIZE exits before init_process_group."""
    import pytest
    import torch.distributed as dist

    from course_lib.examples.train import main

    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "0")
    for argv, constraint in ((["--dp", "2", "--tp", "2"], "the product of the dimensions must equal it"),
                             (["--dp", "2", "--batch", "3"], "must be divisible by dp=2"),
                             (["--pp", "2", "--layers", "1"], "layers"),
                             (["--dp", "2", "--ep", "2"], "has none")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and constraint in err and "Traceback" not in err, (argv, err)
        assert not dist.is_initialized()


def test_the_training_functions_read_their_device_from_the_process_group(monkeypatch):
    """``launch(fn, n, backend="nccl")`` keeps ``backend`` (and its other keywords) for itself:
    a training function with such a parameter never sees it. On an H100 that made every
    ``--backend nccl`` run compute on the CPU and die at FSDP's first all-gather ("No backend
    type associated with device type cpu"). So the functions take none of launch's keywords,
    and ``_device`` follows the process group's backend."""
    import inspect

    import torch.distributed as dist

    from course_lib.examples import train
    from course_lib.launch import launch

    own = {name for name, p in inspect.signature(launch).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert {"backend", "timeout", "clock"} <= own
    for fn in (train.train, train.train_nd):
        assert not own & set(inspect.signature(fn).parameters), fn.__name__
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert train._device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert train._device() == torch.device("cuda", 3)
