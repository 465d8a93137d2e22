"""Checkpoints across layouts (course_lib/checkpoint/): save at step K in one layout, load
in another (another world size, odd sizes, FSDP -> DDP, HSDP -> HSDP / DDP, dp2 x tp2 FSDP -> tp4, pp2 x tp2 ->
pp3, ZeRO on 4 ranks -> ZeRO on 3, N-D -> one device), train on to step STEPS: the losses and
parameters of the uninterrupted single-device run, in float64 within course_lib.tolerance's
AdamW bound, with the optimizer state, the LR schedule and the data order restored (a wrong
one moves the parameters by ~lr, far outside the bound). Resumed models start from another
seed: everything must come from the checkpoint. Then the failures: a rank killed mid-save,
missing / truncated / corrupt shards, a changed model, another format version.

Three launches (4, 3 and 2 ranks) carry every layout pair.
"""
import contextlib
import dataclasses
import json
import os
import shutil

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import RankError
from course_lib.parallel.compose import assemble_nd

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=4, hidden=32, n_heads=4, n_kv_heads=2)   # tp4: K/V copies
TIED = dataclasses.replace(CFG, tie_embeddings=True)
MOE = GPTConfig(vocab_size=96, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_experts=4, top_k=2)
BATCH, STEPS, K, LR = 12, 5, 2, 1e-2      # 12 rows: dp 2, 3 and 4; saved after K of STEPS steps


@contextlib.contextmanager
def _one_thread():
    """The parent's single-device runs on one thread: two OpenMP threads on 2 busy cores wait on
    each other (measured ~10x slower under load); restored for the tests that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _optimizer(params):
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.3, total_iters=4)   # lr changes every step


def _reference(cfg, _done={}):
    """The uninterrupted single-device run: losses and parameters after STEPS steps (once per cfg)."""
    if repr(cfg) in _done:
        return _done[repr(cfg)]
    with _one_thread():
        _done[repr(cfg)] = _train_one_device(cfg)
    return _done[repr(cfg)]


def _train_one_device(cfg):
    model = TinyGPT(cfg, seed=0).double()
    opt, sched = _optimizer(model.parameters())
    losses = []
    for x, y in reference.gpt_batches(cfg, batch=BATCH, steps=STEPS):
        loss = model(x, y, n_tokens=y.numel())[1]
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _single(cfg, load_from, seed=7):
    """Load into one device (export), train on to STEPS."""
    with _one_thread():
        return _resume_one_device(cfg, load_from, seed)


def _resume_one_device(cfg, load_from, seed):
    from course_lib.checkpoint import load

    model = TinyGPT(cfg, seed=seed).double()
    opt, sched = _optimizer(model.parameters())
    start = load(load_from, model, opt, scheduler=sched)["data_state"]["batches_seen"]
    losses = []
    for x, y in reference.gpt_batches(cfg, batch=BATCH, steps=STEPS)[start:]:
        loss = model(x, y, n_tokens=y.numel())[1]
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _plain(cfg, layout, kw, seed):
    """A plain TinyGPT under a chapter 3-4 wrapper: kw wrap= "ddp", "fsdp", "zero1" or "zero2"."""
    from course_lib.parallel.data_parallel import DDP
    from course_lib.parallel.fsdp import FSDP
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.zero import ShardedOptimizer

    mesh, model, wrap = Mesh(**layout), TinyGPT(cfg, seed=seed).double(), kw["wrap"]
    if wrap in ("tp", "pp"):       # chapters 5 and 6 on their own: saved at step 0 only
        if wrap == "tp":
            from course_lib.parallel.tp_plan import parallelize
            parallelize(model, mesh)
        else:
            from course_lib.parallel.pipeline import PipelineParallel
            model = PipelineParallel(model, mesh, microbatches=2)
        return (mesh, model, *_optimizer(model.parameters()))
    if wrap.startswith("zero"):
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, mesh=mesh, stage=int(wrap[-1]), lr=LR,
                               weight_decay=0.1)
        return mesh, model, opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.3, total_iters=4)
    net = (DDP if wrap == "ddp" else FSDP)(model, mesh=mesh)
    return (mesh, net, *_optimizer(net.parameters()))


def _plain_step(mesh, net, x, y):
    """Each rank's mean over its rows; the wrapper averages the ranks: the global mean."""
    import torch.distributed as dist

    rows = x.chunk(mesh.sizes["dp"])[mesh.coord["dp"]], y.chunk(mesh.sizes["dp"])[mesh.coord["dp"]]
    loss = net(*rows, n_tokens=rows[1].numel())[1]
    loss.backward()
    if hasattr(net, "finish_gradient_synchronization"):
        net.finish_gradient_synchronization()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / mesh.sizes["dp"]


def _jobs(jobs):
    """Rank body: for each job (cfg, layout, kw, load_from, save_to, stop), build the layout
    (parallelize_nd, or kw wrap= on a plain model), load or start at step 0, train to ``stop``,
    save. Returns per job (losses, single-device-named shards, bytes written)."""
    from course_lib.checkpoint import load, save
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.fsdp import FSDP
    from course_lib.parallel.mesh import Mesh

    out = []
    for cfg, layout, kw, load_from, save_to, stop in jobs:
        seed = 0 if load_from is None else 11       # loaded: nothing of the init may survive
        if "wrap" in kw:
            mesh, net, opt, sched = _plain(cfg, layout, kw, seed)
        else:
            net = parallelize_nd(TinyGPT(cfg, seed=seed).double(), Mesh(**layout), **kw)
            opt, sched = _optimizer(net.parameters())
        start = 0 if load_from is None else load(load_from, net, opt, scheduler=sched)["data_state"]["batches_seen"]
        losses = []
        for x, y in reference.gpt_batches(cfg, batch=BATCH, steps=STEPS)[start:stop]:
            losses.append(_plain_step(mesh, net, x, y) if "wrap" in kw else net.step(x, y))
            opt.step(), sched.step(), opt.zero_grad()
        written = save(save_to, net, opt, step=stop, data_state={"batches_seen": stop}, scheduler=sched) \
            if save_to else 0
        if "wrap" not in kw:
            shards = net.shards()
        elif kw["wrap"] in ("tp", "pp"):
            shards = {}
        elif isinstance(net, FSDP):
            shards = {n: (t, None) for n, t in net.full_state_dict().items()}
        else:
            shards = {n: (p.detach().clone(), None) for n, p in getattr(net, "module", net).named_parameters()}
        out.append((losses, shards, written))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Layout L1 on 4 ranks saves at step K (and one pair resumes there); layouts on 3 ranks
    resume from them."""
    d = tmp_path_factory.mktemp("ckpt")
    p = {name: str(d / name) for name in ("fsdp_tp", "pp_tp", "zero", "cp_tp", "moe", "pp_tied", "ddp", "tp_alone",
                                                  "pp_alone", "hsdp", "moe_fsdp")}
    four = launch(_jobs, 4, [
        (CFG, dict(dp=2, tp=2), dict(data="fsdp", sequence_parallel=False), None, p["fsdp_tp"], K),
        (CFG, dict(pp=2, tp=2), dict(microbatches=2), None, p["pp_tp"], K),
        (CFG, dict(dp=4), dict(wrap="zero2"), None, p["zero"], K),
        (TIED, dict(cp=2, tp=2), {}, None, p["cp_tp"], K),
        (MOE, dict(dp=4, ep=2), {}, None, p["moe"], 1),
        (CFG, dict(tp=4), {}, p["fsdp_tp"], None, STEPS),                          # dp2 x tp2 FSDP -> tp4
        (TIED, dict(pp=2, dp=2), dict(microbatches=2, schedule="interleaved", v=2), None, p["pp_tied"], K),
        (CFG, dict(dp=4), dict(wrap="ddp"), None, p["ddp"], K),
        (CFG, dict(tp=4), dict(wrap="tp"), None, p["tp_alone"], 0),
        (TIED, dict(pp=2, dp=2), dict(wrap="pp"), None, p["pp_alone"], 0),
        (CFG, dict(dp=4), dict(data="hsdp", shard_size=2), None, p["hsdp"], K),   # 2 replicas x 2 shards
        (MOE, dict(dp=4, ep=2), dict(data="fsdp"), None, p["moe_fsdp"], 1),       # experts' rows over edp
    ], threads=1, timeout=120)
    three = launch(_jobs, 3, [
        (CFG, dict(dp=3), {}, p["fsdp_tp"], None, STEPS),                          # FSDP (4) -> DDP (3)
        (CFG, dict(pp=3), dict(microbatches=2), p["pp_tp"], None, STEPS),          # pp2 x tp2 -> pp3
        (CFG, dict(dp=3), dict(wrap="zero1"), p["zero"], None, STEPS),             # ZeRO-2 (4) -> ZeRO-1 (3)
        (CFG, dict(dp=3), dict(wrap="fsdp"), p["ddp"], None, STEPS),               # DDP (4) -> FSDP (3): odd cuts
        (CFG, dict(dp=3), dict(data="fsdp"), p["pp_tp"], None, STEPS),             # pp2 x tp2 -> N-D FSDP (3)
        (CFG, dict(dp=3), dict(data="hsdp", shard_size=3), p["hsdp"], None, STEPS),  # HSDP 2x2 -> 1x3
        (CFG, dict(dp=3), {}, p["hsdp"], None, STEPS),                             # HSDP 2x2 -> DDP (3)
    ], threads=1, timeout=120)
    return p, four, three


def _check(losses, params, cfg, what):
    want_losses, want = _reference(cfg)
    bound = dict(optimizer="adamw", steps=STEPS, lr=LR)
    tolerance.assert_matches(losses, want_losses[STEPS - len(losses):], what=f"{what}: losses", **bound)
    tolerance.assert_matches(params, want, what=f"{what}: parameters", **bound)


@pytest.mark.parametrize("job", [5])
def test_four_to_four_ranks_fsdp_tp_to_tp4(runs, job):
    _, four, _ = runs
    from course_lib.parallel.mesh import MeshShape
    losses = four[0][job][0]
    _check(losses, assemble_nd([r[job][1] for r in four], MeshShape(tp=4)), CFG, "dp2 x tp2 FSDP -> tp4")


@pytest.mark.parametrize("job,shape,what", [(0, dict(dp=3), "FSDP (4 ranks) -> DDP (3)"),
                                            (1, dict(pp=3), "pp2 x tp2 -> pp3"),
                                            (2, dict(dp=3), "ZeRO-2 (4) -> ZeRO-1 (3)"),
                                            (3, dict(dp=3), "DDP (4) -> FSDP (3)"),
                                            (4, dict(dp=3), "pp2 x tp2 -> FSDP dp3"),
                                            (5, dict(dp=3), "HSDP 2 x 2 (4) -> HSDP 1 x 3"),
                                            (6, dict(dp=3), "HSDP 2 x 2 (4) -> DDP (3)")])
def test_four_to_three_ranks(runs, job, shape, what):
    _, _, three = runs
    from course_lib.parallel.mesh import MeshShape
    full = assemble_nd([r[job][1] for r in three], MeshShape(**shape)) if job != 3 else three[0][job][1]
    full = {n: v[0] if isinstance(v, tuple) else v for n, v in full.items()}
    _check(three[0][job][0], full, CFG, what)


@pytest.mark.parametrize("name,cfg", [("pp_tp", CFG), ("cp_tp", TIED), ("zero", CFG), ("pp_tied", TIED),
                                      ("hsdp", CFG)])
def test_n_d_to_one_device(runs, name, cfg):
    p, _, _ = runs
    _check(*_single(cfg, p[name]), cfg, f"{name} -> one device")


def test_expert_parallel_names_its_experts(runs):
    """dp4 x ep2 MoE: rank r holds experts 2 (r % 2) .. +1 under local indexes; the checkpoint
    holds every expert under its single-device name, written once (dp replicas skipped)."""
    from course_lib.checkpoint import bytes_per_rank, load
    from course_lib.parallel.mesh import MeshShape

    p, four, _ = runs
    model = TinyGPT(MOE, seed=9).double()
    load(p["moe"], model, None)
    want = assemble_nd([r[4][1] for r in four], MeshShape(dp=4, ep=2))
    assert all(torch.equal(q, want[n]) for n, q in model.named_parameters())
    expert = sum(q.numel() * 8 for n, q in model.named_parameters() if ".experts.1." in n)
    assert set(bytes_per_rank(p["moe"])) == {0, 1}        # ranks 2, 3 replicate 0, 1: they write nothing
    assert [r[4][2] for r in four][2:] == [0, 0] and expert > 0


def test_fsdp_experts_are_written_by_the_rows_each_rank_holds(runs):
    """dp4 x ep2 MoE under FSDP: each block's experts sharded over their 2 edp ranks, the rest
    over all 4; every rank holds rows no other rank holds and writes them; loaded into one
    device, the model is the ranks' own, every expert under its single-device name."""
    from course_lib.checkpoint import bytes_per_rank, load
    from course_lib.parallel.mesh import MeshShape

    p, four, _ = runs
    model = TinyGPT(MOE, seed=9).double()
    load(p["moe_fsdp"], model, None)
    want = assemble_nd([r[11][1] for r in four], MeshShape(dp=4, ep=2))
    assert all(torch.equal(q, want[n]) for n, q in model.named_parameters())
    assert set(bytes_per_rank(p["moe_fsdp"])) == {0, 1, 2, 3} and min(r[11][2] for r in four) > 0


def test_hsdp_replicas_write_nothing(runs):
    """HSDP 2 x 2 on 4 ranks: ranks 0, 1 shard the model, ranks 2, 3 replicate them; the
    checkpoint holds each shard once, written by the first replica."""
    from course_lib.checkpoint import bytes_per_rank

    p, four, _ = runs
    written = [r[10][2] for r in four]
    assert set(bytes_per_rank(p["hsdp"])) == {0, 1} and written[2:] == [0, 0] and min(written[:2]) > 0


@pytest.mark.parametrize("name,cfg", [("tp_alone", CFG), ("pp_alone", TIED)])
def test_chapter_5_and_6_wrappers_on_their_own(runs, name, cfg):
    """tp_plan.parallelize (tp4, K/V heads copied) and PipelineParallel (pp2 x dp2, a tied
    embedding on two stages) saved at step 0 load into one device as the initial model."""
    from course_lib.checkpoint import bytes_per_rank, load

    p, _, _ = runs
    model = TinyGPT(cfg, seed=5).double()
    load(p[name], model, _optimizer(model.parameters())[0])
    init = TinyGPT(cfg, seed=0).double()
    assert all(torch.equal(q, init.state_dict()[n]) for n, q in model.named_parameters())
    unique = sum(q.numel() * 8 for q in init.parameters())
    assert sum(bytes_per_rank(p[name]).values()) == unique       # no optimizer state yet; replicas once


def _async_then_kill_mid_save(root):
    """2 ranks (dp2 FSDP): an asynchronous save at step 1 whose write overlaps step 2 (which
    changes every parameter: the snapshot must be the step-1 values), then rank 1 dies halfway
    through writing a synchronous save at step 2."""
    import torch.distributed as dist

    from course_lib.checkpoint import AsyncSaver, store
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(dp=2), data="fsdp")
    opt, sched = _optimizer(net.parameters())
    saver = AsyncSaver()
    for step, (x, y) in enumerate(reference.gpt_batches(CFG, batch=BATCH, steps=2), start=1):
        net.step(x, y), opt.step(), sched.step(), opt.zero_grad()
        if step == 1:
            saver.save(os.path.join(root, "step1"), net, opt, step=1, data_state={"batches_seen": 1},
                       scheduler=sched)
    saver.wait()
    if dist.get_rank() == 1:
        def die(file, chunks):
            with open(file, "wb") as f:
                f.write(bytes(chunks[0])[:100])
            os._exit(3)
        store._fsync_write = die
    store.save(os.path.join(root, "step2"), net, opt, step=2, data_state={"batches_seen": 2}, scheduler=sched)


def test_async_save_and_a_rank_killed_mid_save(tmp_path):
    from course_lib.checkpoint import load

    with pytest.raises(RankError, match="rank 1 exited with code 3"):
        launch(_async_then_kill_mid_save, 2, str(tmp_path), threads=1, timeout=60)
    assert not (tmp_path / "step2").exists()                        # nothing that looks complete
    assert (tmp_path / "step2.partial").is_dir()
    with pytest.raises(ValueError, match="metadata.json: not a complete checkpoint"):
        load(tmp_path / "step2.partial", TinyGPT(CFG).double())
    _check(*_single(CFG, tmp_path / "step1"), CFG, "async save (dp2 FSDP) -> one device")


def _damaged(src, dst, how):
    shutil.copytree(src, dst)
    meta = json.loads((dst / "metadata.json").read_text())
    shard = meta["tensors"]["model.blocks.1.mlp.w2.weight"]["shards"][0]
    file = dst / shard["file"]
    if how == "missing":
        file.unlink()
    elif how == "truncated":
        os.truncate(file, shard["byte_offset"] + shard["nbytes"] - 1)
    elif how == "corrupt":
        raw = bytearray(file.read_bytes())
        raw[shard["byte_offset"]] ^= 1
        file.write_bytes(bytes(raw))
    elif how == "version":
        meta["version"] = 0
        (dst / "metadata.json").write_text(json.dumps(meta))
    return file.name


@pytest.mark.parametrize("how,message", [
    ("missing", r"rank0000\d.bin is missing \(it holds tensor 'model\.[a-z_.0-9]*'\)"),
    ("truncated", r"rank0000\d.bin is truncated: .* tensor 'model.blocks.1.mlp.w2.weight'"),
    ("corrupt", r"rank0000\d.bin is corrupt: the bytes of tensor 'model.blocks.1.mlp.w2.weight'"),
    ("version", r"metadata.json is format 'course_lib.checkpoint' version 0"),
])
def test_damaged_checkpoints_are_refused(runs, tmp_path, how, message):
    from course_lib.checkpoint import load

    p, _, _ = runs
    _damaged(type(tmp_path)(p["pp_tp"]), tmp_path / "c", how)
    with pytest.raises(ValueError, match=message):
        load(tmp_path / "c", TinyGPT(CFG).double())


@pytest.mark.parametrize("cfg,message", [
    (dataclasses.replace(CFG, n_layers=3), r"tensor 'model.blocks.3.attn.wq.weight' of the checkpoint is not in"),
    (dataclasses.replace(CFG, n_layers=5), r"the checkpoint has no tensor 'model.blocks.4.attn_norm.weight'"),
    (dataclasses.replace(CFG, ffn_hidden=64), r"'model.blocks.0.mlp.w1.weight' is float64 \(96, 32\) in the "
                                              r"checkpoint, float64 \(64, 32\) here"),
])
def test_a_changed_model_is_refused(runs, cfg, message):
    from course_lib.checkpoint import load

    p, _, _ = runs
    model = TinyGPT(cfg, seed=0).double()
    before = {n: q.clone() for n, q in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        load(p["pp_tp"], model, _optimizer(model.parameters())[0])
    assert all(torch.equal(q, before[n]) for n, q in model.named_parameters())   # nothing half-loaded


def test_reshard_figure_draws_the_overlaps_one_new_rank_reads():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.viz.checkpoint import reshard_figure

    saved = [((0, 0), (16, 48), "r0"), ((0, 48), (16, 48), "r1"), ((16, 0), (16, 48), "r2"), ((16, 48), (16, 48), "r3")]
    new = [((0, 0), (11, 96), "n0"), ((11, 0), (11, 96), "n1"), ((22, 0), (10, 96), "n2")]
    fig = reshard_figure((32, 96), saved, new, reader=1)
    assert len(fig.axes) == 3 and fig.axes[2].get_title() == "n1 reads 4 saved boxes, copies their overlaps"
    with pytest.raises(ValueError, match="2-D"):
        reshard_figure((4, 4, 4), saved, new)


# ----------------------------------------------------------------------------- durability, RNG, a safe extra.pt

def test_the_publish_fsyncs_every_file_then_the_partial_directory_then_the_rename(tmp_path, monkeypatch):
    """A file's name lives in its directory: without an fsync of ``.partial`` itself, a crash
    after the rename may publish a directory whose files' entries never reached the disk."""
    from course_lib.checkpoint import save

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("reads which file an fd is from /proc (Linux)")
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    model = TinyGPT(CFG, seed=0).double()
    save(tmp_path / "c", model, _optimizer(model.parameters())[0], step=3)
    partial = str(tmp_path / "c.partial")
    assert synced == [f"{partial}/rank00000.bin", f"{partial}/extra.pt", f"{partial}/metadata.json", partial,
                      str(tmp_path)]


def _draws_after_resume(root):
    """Each rank seeds its own stream (a TP run's dropout), saves, draws; loads, draws again."""
    import torch.distributed as dist

    from course_lib.checkpoint import load, save
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    torch.manual_seed(100 + dist.get_rank())
    net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(tp=2))
    save(os.path.join(root, "c"), net, step=1)
    after_save = torch.rand(3)
    torch.manual_seed(7)                                       # anything: load restores the stream
    load(os.path.join(root, "c"), net)
    return after_save, torch.rand(3)


def test_every_ranks_rng_state_is_saved_and_restored(tmp_path):
    from course_lib.checkpoint import load

    got = launch(_draws_after_resume, 2, str(tmp_path), threads=1)
    assert not torch.equal(got[0][0], got[1][0])               # two streams ...
    assert all(torch.equal(saved, resumed) for saved, resumed in got)   # ... each resumed on its rank
    torch.manual_seed(7)
    load(tmp_path / "c", TinyGPT(CFG, seed=1).double())        # another world size: rank 0's stream
    assert torch.equal(torch.rand(3), got[0][0])


class _NotPlain:
    pass


def test_extra_holds_plain_values_and_loads_weights_only(tmp_path):
    import zlib

    from course_lib.checkpoint import load, save

    model = TinyGPT(CFG, seed=0).double()
    with pytest.raises(ValueError, match=r"data_state .* plain values .*Unsupported global: .*_NotPlain"):
        save(tmp_path / "bad", model, data_state={"sampler": _NotPlain()})
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()
    save(tmp_path / "c", model, _optimizer(model.parameters())[0], step=2, data_state={"batches_seen": 2})
    extra = torch.load(tmp_path / "c" / "extra.pt", weights_only=True)   # what load does
    assert extra["step"] == 2 and len(extra["rng"]) == 1
    torch.save({**extra, "payload": _NotPlain()}, tmp_path / "c" / "extra.pt")   # a planted object
    meta = json.loads((tmp_path / "c" / "metadata.json").read_text())
    meta["extra"]["crc32"] = zlib.crc32((tmp_path / "c" / "extra.pt").read_bytes())
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"extra.pt holds more than plain values.*weights_only=True"):
        load(tmp_path / "c", TinyGPT(CFG, seed=1).double())
