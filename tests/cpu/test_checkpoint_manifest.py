"""ds_comet.checkpoints: the manifest a save writes, what a resume refuses, and which checkpoint it offers.

The collective cases run on every rank of the gloo pool with ``Engine``, a stand-in for a DeepSpeed
engine that writes a file per rank and one from rank 0, as DeepSpeed's checkpoints are laid out; the
last cases save and load real DeepSpeed engines (stock MoE layers under ZeRO-2, a dense model under
ZeRO-3) through the module. examples/train_moe.py's end-to-end runs (tests/cpu/test_example.py) cover
a rank that dies mid-save and a resume that refuses a checkpoint.
"""

import errno
import hashlib
import os
import re
import shutil
import subprocess

import deepspeed
import pytest
import torch
from deepspeed import comm as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

import ds_comet
from ds_comet import checkpoints
from ds_comet.experts import FeedForward

SHAPE = {"ranks": 2, "--experts": 8, "--hidden": 64}


class _CheckpointEngine:
    def __init__(self, decoupled):
        self.decoupled = decoupled

    def is_decoupled(self):
        return self.decoupled


class Engine:
    """What ds_comet.checkpoints uses of a DeepSpeed engine: each rank writes its own file, rank 0 also
    one in a subdirectory; ``full_disk`` makes every rank's write fail as a full disk does."""

    def __init__(self, payload=b"weights", full_disk=False, decoupled=False):
        self.payload, self.full_disk = payload, full_disk
        self.checkpoint_engine = _CheckpointEngine(decoupled)
        self.loaded = []

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False, "DeepSpeed's own 'latest' would name a checkpoint before it is whole"
        rank, directory = dist.get_rank(), os.path.join(save_dir, tag)
        os.makedirs(os.path.join(directory, "nested"), exist_ok=True)
        with open(os.path.join(directory, f"rank{rank}_states.pt"), "wb") as handle:
            if self.full_disk:
                raise OSError(errno.ENOSPC, "No space left on device", handle.name)
            handle.write(self.payload * (1000 + rank))
        if rank == 0:
            torch.save(dict(client_state), os.path.join(directory, "nested", "client_state.pt"))
        dist.barrier()

    def load_checkpoint(self, save_dir, tag):
        self.loaded.append(tag)
        path = os.path.join(save_dir, tag)
        return path, torch.load(os.path.join(path, "nested", "client_state.pt"))


def file_sha256(path):
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def damage(path):
    """Changes bytes in the middle of a file, keeping its size (a bad sector, not a short file)."""
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        handle.write(b"\x00\xff" * 8)


def raised(call):
    """(exception type name, message) of what ``call()`` raises on this rank, or None."""
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


# --------------------------------------------------------------------------------------------
# Cases that every rank of the pool runs
# --------------------------------------------------------------------------------------------


def save_case(save_dir):
    engine = Engine()
    saved = checkpoints.save_checkpoint(engine, save_dir, "step3", {"step": 3}, SHAPE)
    checks = checkpoints.checkpoint_problems(save_dir, "step3")
    checkpoints.verify_checkpoint(save_dir, "step3", SHAPE)
    load_path, client_state = checkpoints.load_checkpoint(engine, save_dir, "step3", SHAPE)
    return saved, checks, load_path, client_state, engine.loaded


def test_save_writes_a_manifest_of_every_file(cpu_pool, tmp_path):
    save_dir = str(tmp_path)
    results = cpu_pool.run(save_case, save_dir=save_dir)
    saved, checks, load_path, client_state, loaded = results[0]
    directory = os.path.join(save_dir, "step3")
    files = sorted(
        os.path.relpath(os.path.join(root, name), directory) for root, _, names in os.walk(directory) for name in names
    )
    expected = sorted(
        [f"rank{r}_states.pt" for r in range(cpu_pool.world_size)]
        + ["nested/client_state.pt", "run.json", "SHA256SUMS"]
    )
    assert files == expected
    manifest = checkpoints.read_manifest(directory)
    assert sorted(manifest) == [name for name in expected if name != "SHA256SUMS"]
    assert all(file_sha256(os.path.join(directory, name)) == digest for name, digest in manifest.items())
    # The staging directory took the tag's name, and only then did `latest` name it.
    assert sorted(os.listdir(save_dir)) == ["latest", "step3"]
    assert checkpoints.read_latest(save_dir) == "step3"
    size = sum(os.path.getsize(os.path.join(directory, name)) for name in manifest)
    assert saved == checkpoints.SavedCheckpoint(directory, len(manifest), size)
    assert all(result == results[0] for result in results)  # every rank returns the same
    assert checks == [] and loaded == ["step3"] and load_path == directory and client_state == {"step": 3}
    if shutil.which("sha256sum"):  # the manifest is sha256sum's own format
        done = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=directory, capture_output=True)
        assert done.returncode == 0, done.stdout + done.stderr


def resave_case(save_dir):
    first = checkpoints.save_checkpoint(Engine(b"first"), save_dir, "step1", {"step": 1})
    again = checkpoints.save_checkpoint(Engine(b"again"), save_dir, "step1", {"step": 1})
    return first, again


def test_saving_a_tag_again_replaces_it_whole(cpu_pool, tmp_path):
    save_dir = str(tmp_path)
    cpu_pool.run(resave_case, save_dir=save_dir)
    directory = os.path.join(save_dir, "step1")
    with open(os.path.join(directory, "rank0_states.pt"), "rb") as handle:
        assert handle.read(5) == b"again"
    assert sorted(os.listdir(save_dir)) == ["latest", "step1"]  # no .replaced or .saving left
    assert "run.json" not in checkpoints.read_manifest(directory)  # saved without a run shape


def failed_save_case(save_dir):
    checkpoints.save_checkpoint(Engine(b"intact"), save_dir, "step1", {"step": 1}, SHAPE)
    full = raised(lambda: checkpoints.save_checkpoint(Engine(full_disk=True), save_dir, "step1", {"step": 1}, SHAPE))
    problems = checkpoints.checkpoint_problems(save_dir, "step1")
    # A rank-0 step that fails ends every rank's save, not only rank 0's: here the staging directory
    # cannot be cleared, for a file stands in its place.
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "step2.saving"), "w") as handle:
            handle.write("not a directory")
    dist.barrier()
    blocked = raised(lambda: checkpoints.save_checkpoint(Engine(), save_dir, "step2", {"step": 2}))
    return full, problems, blocked


def test_a_failed_save_keeps_latest_and_the_earlier_checkpoint(cpu_pool, tmp_path):
    save_dir = str(tmp_path)
    results = cpu_pool.run(failed_save_case, save_dir=save_dir)
    for rank, (full, problems, blocked) in enumerate(results):
        kind, message = full
        assert kind == "DiskFullError", full
        pattern = r"saving checkpoint step1: the disk is full: [0-9.]+ \w+ free under " + re.escape(save_dir)
        assert re.search(pattern, message), message
        assert problems == [], problems  # the earlier step1, whole
        if rank == 0:
            assert blocked[0] == "OSError" and "left by an earlier save, cannot be removed" in blocked[1], blocked
        else:
            assert blocked[0] == "RuntimeError" and blocked[1].startswith(
                "saving checkpoint step2: rank 0 failed: OSError"
            )
    assert checkpoints.read_latest(save_dir) == "step1"
    with open(os.path.join(save_dir, "step1", "rank0_states.pt"), "rb") as handle:
        assert handle.read(6) == b"intact"
    assert os.path.isdir(os.path.join(save_dir, "step1.saving")), "the failed save's files are left for a look"


class FailingEngine(Engine):
    """``Engine`` whose save fails on every rank but 0 once DeepSpeed's part is done (a disk error
    there): rank 0 goes on to hash the files, and waits for the others."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        super().save_checkpoint(save_dir, tag, client_state, save_latest)
        if dist.get_rank() != 0:
            raise OSError(errno.EIO, "stand-in: Input/output error", os.path.join(save_dir, tag))


def failed_on_a_peer_case(save_dir):
    """The save's own collectives wait at most ds_comet.collectives' bound (here 1 s, from
    "wait_timeout_s"): returns rank 0's error, which names the rank and what it raised."""
    from ds_comet import collectives
    from ds_comet.kernels.ops import CometWaitTimeout

    collectives.set_wait_timeout(1.0)
    if dist.get_rank() != 0:
        with pytest.raises(OSError, match="stand-in"):
            checkpoints.save_checkpoint(FailingEngine(), save_dir, "step3", {"step": 3})
        return None
    with pytest.raises(CometWaitTimeout) as raised:
        checkpoints.save_checkpoint(FailingEngine(), save_dir, "step3", {"step": 3})
    return str(raised.value)


def test_a_rank_that_fails_during_a_save_ends_its_peers_waits_by_name(cpu_pool, tmp_path):
    try:
        message = cpu_pool.run(failed_on_a_peer_case, save_dir=str(tmp_path), timeout=60)[0]
    finally:
        cpu_pool.stop()  # rank 0's gather is still posted on the default group
    others = ", ".join(str(rank) for rank in range(1, cpu_pool.world_size))
    assert message.startswith("ds_comet: saving checkpoint step3: rank 0 of the job (global ranks "), message
    assert f"global rank(s) {others} of the group did not report a wait of their own within 1 s more" in message
    for rank in range(1, cpu_pool.world_size):
        assert f"global rank {rank} raised in saving checkpoint step3: OSError: [Errno 5] stand-in" in message
    assert checkpoints.read_latest(str(tmp_path)) is None  # nothing named whole


def damaged_case(save_dir):
    for step in (5, 10, 20):
        checkpoints.save_checkpoint(Engine(), save_dir, f"step{step}", {"step": step}, SHAPE)
    if dist.get_rank() == 0:
        damage(os.path.join(save_dir, "step20", "rank1_states.pt"))
        os.remove(os.path.join(save_dir, "step20", "nested", "client_state.pt"))
    dist.barrier()
    problems = checkpoints.checkpoint_problems(save_dir, "step20")
    engine = Engine()
    refused = raised(lambda: checkpoints.load_checkpoint(engine, save_dir, "step20", SHAPE))
    newest = checkpoints.newest_intact_checkpoint(save_dir)
    if dist.get_rank() == 0:
        damage(os.path.join(save_dir, "step10", "rank0_states.pt"))
    dist.barrier()
    after_step10 = checkpoints.newest_intact_checkpoint(save_dir)
    if dist.get_rank() == 0:
        os.remove(os.path.join(save_dir, "step5", checkpoints.MANIFEST))
    dist.barrier()
    none_left = raised(lambda: checkpoints.verify_checkpoint(save_dir, "step20"))
    return problems, refused, engine.loaded, newest, after_step10, none_left


def test_damaged_files_are_named_and_the_newest_intact_checkpoint_offered(cpu_pool, tmp_path):
    save_dir = str(tmp_path)
    results = cpu_pool.run(damaged_case, save_dir=save_dir)
    assert all(result == results[0] for result in results)
    problems, refused, loaded, newest, after_step10, none_left = results[0]
    assert problems == [
        "step20/nested/client_state.pt: missing",
        "step20/rank1_states.pt: damaged (its sha256 is not the one step20/SHA256SUMS recorded at the save)",
    ]
    kind, message = refused
    assert kind == "DamagedCheckpointError" and loaded == [], "loaded a damaged checkpoint"
    assert message == (
        f"checkpoint step20 in {save_dir} is damaged; not resuming from it:\n  "
        + "\n  ".join(problems)
        + "\nthe newest intact checkpoint is step10"
    )
    # Newest by the number a tag ends in (step10 before step5, though "step5" sorts after "step10").
    assert (newest, after_step10) == ("step10", "step5")
    assert none_left[0] == "DamagedCheckpointError"
    assert none_left[1].endswith(f"\nno other checkpoint in {save_dir} is intact"), none_left


def shape_case(save_dir):
    checkpoints.save_checkpoint(Engine(), save_dir, "step4", {"step": 4}, SHAPE)
    checkpoints.save_checkpoint(Engine(), save_dir, "unshaped", {"step": 4})
    other = dict(SHAPE, **{"--experts": 4, "ranks": 3})
    engine = Engine()
    mismatch = raised(lambda: checkpoints.load_checkpoint(engine, save_dir, "step4", other))
    return (
        mismatch,
        engine.loaded,
        checkpoints.shape_differences(save_dir, "step4", SHAPE),
        checkpoints.shape_differences(save_dir, "unshaped", other),
        raised(lambda: checkpoints.verify_checkpoint(save_dir, "step4")),  # no shape given: not compared
    )


def test_a_checkpoint_of_another_shape_is_refused(cpu_pool, tmp_path):
    save_dir = str(tmp_path)
    results = cpu_pool.run(shape_case, save_dir=save_dir)
    assert all(result == results[0] for result in results)
    mismatch, loaded, same, unshaped, unchecked = results[0]
    assert mismatch == (
        "RunShapeMismatchError",
        f"checkpoint step4 in {save_dir} was saved by a run of another shape: ranks 2 (this run: 3), "
        "--experts 8 (this run: 4)",
    )
    assert loaded == [], "loaded a checkpoint of another shape"
    assert same == [] and unshaped == [] and unchecked is None


# --------------------------------------------------------------------------------------------
# Without the pool: what needs no collective
# --------------------------------------------------------------------------------------------


def test_find_checkpoint(tmp_path):
    save_dir = str(tmp_path)
    with pytest.raises(checkpoints.CheckpointNotFoundError, match="the directory does not exist"):
        checkpoints.find_checkpoint(os.path.join(save_dir, "absent"))
    with pytest.raises(checkpoints.CheckpointNotFoundError, match="it has no 'latest' file"):
        checkpoints.find_checkpoint(save_dir)
    for name in ("step2", "step4.replaced"):
        os.makedirs(tmp_path / name)
    (tmp_path / "latest").write_text("step2\n")
    assert checkpoints.find_checkpoint(save_dir) == "step2"
    assert checkpoints.find_checkpoint(save_dir, "step2") == "step2"
    # A run that stopped between a save's two renames left step4 under its .replaced name.
    hint = "step4.replaced is its earlier copy, which a save was replacing when the run stopped: rename it to step4"
    with pytest.raises(checkpoints.CheckpointNotFoundError) as missing:
        checkpoints.find_checkpoint(save_dir, "step4")
    assert (
        str(missing.value)
        == f"no checkpoint step4 in {save_dir} (there: step2, step4.replaced); {hint} to resume from it"
    )


@pytest.mark.parametrize("content", [b"\x80\x04\x95binary\xff", b"step2\x00\x01"], ids=["not-utf8", "control"])
def test_a_latest_that_is_not_text_is_named(tmp_path, content):
    os.makedirs(tmp_path / "step2")
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(checkpoints.CheckpointNotFoundError) as raised:
        checkpoints.find_checkpoint(str(tmp_path))
    assert str(raised.value).startswith(
        f"{tmp_path / 'latest'} is not text ({len(content)} bytes, starting {content!r}): a save writes the tag"
    ), raised.value
    assert checkpoints.find_checkpoint(str(tmp_path), "step2") == "step2"  # a tag named still resumes


def test_a_save_directory_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where the save directory's parent should be")
    with pytest.raises(checkpoints.CheckpointError, match=f"checkpoints cannot be written to {blocker}/ckpt: "):
        checkpoints.check_writable(str(blocker / "ckpt"))
    checkpoints.check_writable(str(tmp_path / "made"))
    assert os.listdir(tmp_path / "made") == []  # made, and its trial file removed


def test_what_save_refuses_before_writing(tmp_path):
    # Checked before any collective, so no process group is needed here.
    with pytest.raises(checkpoints.CheckpointError, match="writes in the background"):
        checkpoints.save_checkpoint(Engine(decoupled=True), str(tmp_path), "step1")
    for tag in ("", "a/b", "latest", "step1.saving", "step1.replaced", ".."):
        with pytest.raises(ValueError, match="a tag is a plain directory name"):
            checkpoints.save_checkpoint(Engine(), str(tmp_path), tag)
    assert os.listdir(tmp_path) == []


def test_a_malformed_manifest_is_named(tmp_path):
    (tmp_path / "SHA256SUMS").write_text(f"{'0' * 64}  a.pt\nnot a line\n")
    with pytest.raises(ValueError, match="line 2 is not '<sha256>  <file>'"):
        checkpoints.read_manifest(str(tmp_path))
    assert checkpoints.read_manifest(str(tmp_path / "none")) is None


def test_a_full_disk_is_named(tmp_path):
    # torch.save's zip writer reports a short write as RuntimeError("... unexpected pos ..."), a
    # plain write as OSError ENOSPC; /dev/full fails every write with ENOSPC.
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    for write in (
        lambda: torch.save({"weights": torch.zeros(1 << 16)}, "/dev/full"),
        lambda: open("/dev/full", "wb").write(b"x" * (1 << 20)),
    ):
        with pytest.raises(checkpoints.DiskFullError) as raised_error:
            with checkpoints.explain_disk_full(str(tmp_path), "saving checkpoint step7"):
                write()
        message = str(raised_error.value)
        assert raised_error.value.errno == errno.ENOSPC
        expected = r"saving checkpoint step7: the disk is full: [0-9.]+ \w+ free under " + re.escape(str(tmp_path))
        assert re.search(expected, message), message
    # Anything else passes unchanged.
    with pytest.raises(PermissionError):
        with checkpoints.explain_disk_full(str(tmp_path), "saving"):
            raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(RuntimeError, match="other"):
        with checkpoints.explain_disk_full(str(tmp_path), "saving"):
            raise RuntimeError("other")


# --------------------------------------------------------------------------------------------
# Real engines
# --------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, ds_config, moe):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        ep_size = dist.get_world_size()
        expert = FeedForward(16, 24)
        self.moe = self.ffn = None
        if moe:
            self.moe = ds_comet.build_moe(
                ds_config, hidden_size=16, expert=expert, num_experts=2 * ep_size, ep_size=ep_size, k=2
            )
        else:
            self.ffn = expert
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        hidden = torch.tanh(self.inp(x))
        hidden = self.moe(hidden)[0] if self.moe is not None else self.ffn(hidden)
        return self.out(hidden)


def make_engine(zero_stage, moe, seed):
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "moe": {"backend": "comet", "overlap": "none"},
    }
    torch.manual_seed(seed)
    model = Net(ds_config, moe)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=ds_config)
    return engine


def weights(engine):
    if engine.zero_optimization_stage() == 3:  # partitioned: gather each parameter whole
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in engine.module.parameters()]


def engine_case(save_dir, zero_stage, moe):
    engine = make_engine(zero_stage, moe, seed=1)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(x).square().mean())
    engine.step()
    saved = checkpoints.save_checkpoint(engine, save_dir, "step1", {"step": 1}, SHAPE)
    other = make_engine(zero_stage, moe, seed=2)  # other weights: the load must do the work
    _, client_state = checkpoints.load_checkpoint(other, save_dir, "step1", SHAPE)
    same = all(torch.equal(a, b) for a, b in zip(weights(engine), weights(other)))
    return saved.files, client_state, same


@pytest.mark.parametrize("zero_stage,moe", [(2, True), (3, False)], ids=["moe-zero2", "dense-zero3"])
def test_real_engines_save_and_load_through_the_manifest(cpu_pool, tmp_path, zero_stage, moe):
    save_dir = str(tmp_path)
    results = cpu_pool.run(engine_case, save_dir=save_dir, zero_stage=zero_stage, moe=moe)
    files, client_state, _ = results[0]
    assert client_state["step"] == 1 and all(same for *_, same in results), results
    manifest = checkpoints.read_manifest(os.path.join(save_dir, "step1"))
    assert len(manifest) == files and "run.json" in manifest
    optimizer_files = [name for name in manifest if name.endswith("optim_states.pt")]
    assert len(optimizer_files) == cpu_pool.world_size, sorted(manifest)
    if moe:
        assert any(name.startswith("layer_0_expert_") for name in manifest), sorted(manifest)
    assert checkpoints.read_latest(save_dir) == "step1"
