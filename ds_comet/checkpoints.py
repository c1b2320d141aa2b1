"""Checkpoints a resume can trust: a checksum manifest, staged saves, and a record of the run's shape.

For any DeepSpeed engine (stock MoE layers, AutoEP, ZeRO stages 0 to 3), in place of
``engine.save_checkpoint`` and ``engine.load_checkpoint``::

    tag = checkpoints.find_checkpoint(save_dir)  # 'latest', or a tag given; before the process group
    ...
    load_path, client_state = checkpoints.load_checkpoint(engine, save_dir, tag, run_shape)
    ...
    checkpoints.save_checkpoint(engine, save_dir, f"step{step}", {"step": step}, run_shape)

``save_checkpoint`` has the engine write checkpoint ``tag`` into ``<tag>.saving``. Once every rank
has written its files, the ranks hash them and wait until they are on the disk; rank 0 writes their
sha256 to ``SHA256SUMS`` (``sha256sum -c SHA256SUMS`` reads it), puts the directory in place of any
earlier ``<tag>`` and only then points ``latest`` at it. A save that fails (a rank that dies, a full
disk) leaves ``latest`` and an earlier checkpoint of the same tag as they were. ``run_shape`` is what
the number and shapes of the checkpoint's files depend on (the rank count, the model's sizes: any
JSON object); it is saved as ``run.json``, listed in the manifest.

``load_checkpoint`` checks every file against the manifest, and the run against ``run.json``, before
the engine loads anything: ``DamagedCheckpointError`` names the damaged or missing files and the
newest intact checkpoint, ``RunShapeMismatchError`` what differs.

A save directory holds:

- ``<tag>/``: DeepSpeed's files, ``run.json`` and ``SHA256SUMS``;
- ``latest``: the tag of the newest whole checkpoint (DeepSpeed's file, which its loader and
  ``zero_to_fp32.py`` read);
- ``<tag>.saving/``: a save under way, or the files of one that failed (the next save of that tag
  removes them);
- ``<tag>.replaced/``: the earlier ``<tag>`` for the moment of the swap, left only by a run that
  stopped then (``find_checkpoint`` names it).

The functions that say "collective" must be called by every rank together. Like DeepSpeed's loader,
they assume that every rank sees the whole save directory. Every exchange between ranks in this
module goes through ``_on_rank0`` (a step rank 0 runs, its result or its failure given to every
rank) and ``_gather`` (one value from each rank, all of them to every rank), which wait at most
``ds_comet.collectives``' bound, besides the barriers of ``engine.save_checkpoint`` itself, which the
process group's timeout bounds (``collectives.peers_named``): a rank that stops during a save ends
its peers' waits with an error naming it (``CometWaitTimeout``).
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from deepspeed import comm as dist

from . import collectives

MANIFEST = "SHA256SUMS"
LATEST = "latest"
RUN_SHAPE = "run.json"
STAGING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or resumed from; the message says why."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint to resume from: no save directory, no ``latest``, or no checkpoint of the tag asked for."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files do not match its manifest.

    Attributes:
        tag: the damaged checkpoint.
        problems: one line per damaged or missing file (or for a missing or unreadable manifest).
        intact: the newest other checkpoint of the save directory whose files all match, or None.
    """

    def __init__(self, save_dir: str, tag: str, problems: list[str], intact: str | None):
        self.tag, self.problems, self.intact = tag, problems, intact
        advice = (
            f"the newest intact checkpoint is {intact}" if intact else f"no other checkpoint in {save_dir} is intact"
        )
        super().__init__(
            f"checkpoint {tag} in {save_dir} is damaged; not resuming from it:\n  "
            + "\n  ".join(problems)
            + f"\n{advice}"
        )


class RunShapeMismatchError(CheckpointError):
    """A checkpoint saved by a run of another shape.

    Attributes:
        tag: the checkpoint.
        differences: one ``"<key> <saved value> (this run: <value>)"`` per key that differs.
    """

    def __init__(self, save_dir: str, tag: str, differences: list[str]):
        self.tag, self.differences = tag, differences
        super().__init__(
            f"checkpoint {tag} in {save_dir} was saved by a run of another shape: {', '.join(differences)}"
        )


class DiskFullError(OSError):
    """A checkpoint write that ran out of space; the message names the directory and its free space."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """What ``save_checkpoint`` wrote: the checkpoint's directory, its number of files and their total size."""

    path: str
    files: int
    size_bytes: int


# --------------------------------------------------------------------------------------------
# Every exchange between ranks
# --------------------------------------------------------------------------------------------


def _on_rank0(step: Callable[[], T], what: str) -> T:
    """``step()`` run on rank 0 alone, its result on every rank (collective).

    If it raises, rank 0 raises its exception and every other rank a RuntimeError quoting it (naming
    ``what`` was being done), rather than wait for rank 0 in the job's next collective.
    """
    outcome, raised = None, None
    if dist.get_rank() == 0:
        try:
            outcome = (True, step())
        except Exception as error:
            raised, outcome = error, (False, f"{type(error).__name__}: {error}")
    done, value = collectives.all_gather_object(outcome, what, "rank 0's part of it")[0]
    if raised is not None:
        raise raised
    if not done:
        raise RuntimeError(f"{what}: rank 0 failed: {value}")
    return value


def _gather(value: T, where: str, what: str) -> list[T]:
    """[rank 0's value, rank 1's, ...] on every rank (collective); ``where`` (the step) and ``what``
    (the values) name the wait in its error."""
    return collectives.all_gather_object(value, where, what)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _free_space(directory: str) -> str:
    """Free space of the filesystem that holds ``directory`` (or its nearest existing parent), as text."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024 or unit == "GiB":
            return f"{free:.1f} {unit}" if unit != "B" else f"{free} B"
        free /= 1024


@contextlib.contextmanager
def explain_disk_full(directory: str, what: str):
    """Re-raises a write that failed for want of space as ``DiskFullError``.

    Recognised: OSError with ENOSPC or EDQUOT, and the RuntimeError "unexpected pos" of torch's zip
    writer, which is how ``torch.save`` reports a write that came up short. Other errors pass unchanged.

    Args:
        directory: where the write went; the message gives the free space there.
        what: what was being written, the start of the message (e.g. ``"saving checkpoint step7"``).
    """
    try:
        yield
    except DiskFullError:
        raise
    except (OSError, RuntimeError) as error:
        space = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        short_write = isinstance(error, RuntimeError) and "unexpected pos" in str(error)
        if not (space or short_write):
            raise
        raise DiskFullError(
            errno.ENOSPC,
            f"{what}: the disk is full: {_free_space(directory)} free under "
            f"{directory} ({type(error).__name__}: {error})",
        ) from error


def _file_sha256(path: str, flush_to_disk: bool = False) -> str:
    """Hex sha256 of the file; with ``flush_to_disk``, also waits until its data is on the disk."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
        if flush_to_disk:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _write_atomically(path: str, text: str):
    """Writes ``text`` to ``path`` so that a reader finds the old content or the new, never part of it."""
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)


def _checkpoint_files(checkpoint_dir: str) -> list[str]:
    """The files under ``checkpoint_dir``, as sorted paths relative to it, less the manifest and its temporary."""
    found = []
    for directory, _, files in os.walk(checkpoint_dir):
        for name in files:
            relative = os.path.relpath(os.path.join(directory, name), checkpoint_dir)
            if relative not in (MANIFEST, MANIFEST + ".tmp"):
                found.append(relative)
    return sorted(found)


def _shared_sha256(checkpoint_dir: str, names: list[str], where: str, flush_to_disk: bool = False):
    """({name: sha256}, {name: why it could not be read}) of ``names`` under ``checkpoint_dir``.

    Collective: each rank hashes every world-size-th file and every rank gets all the results;
    ``where`` names the step in the error of a wait that times out.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    digests, errors = {}, {}
    for name in names[rank::world_size]:
        try:
            digests[name] = _file_sha256(os.path.join(checkpoint_dir, name), flush_to_disk)
        except FileNotFoundError:
            errors[name] = "missing"
        except OSError as error:
            errors[name] = f"cannot be read ({error})"
    gathered = _gather((digests, errors), where, "the sha256 of the files the other ranks hashed")
    return (
        {k: v for part, _ in gathered for k, v in part.items()},
        {k: v for _, part in gathered for k, v in part.items()},
    )


def read_latest(save_dir: str) -> str | None:
    """The tag that ``save_dir``'s ``latest`` names; None when there is no such file (or it is empty).

    Raises:
        CheckpointNotFoundError: ``latest`` holds no text (binary bytes, control characters).
    """
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    try:
        tag = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    if tag is None or not tag.isprintable():
        raise CheckpointNotFoundError(
            f"{path} is not text ({len(data)} bytes, starting {data[:16]!r}): a save writes the tag of the "
            "checkpoint it finished there, so another program wrote or damaged it; name the checkpoint "
            "to resume from, or remove the file"
        )
    return tag or None


def read_manifest(checkpoint_dir: str) -> dict[str, str] | None:
    """``{path relative to checkpoint_dir: hex sha256}`` from the checkpoint's manifest; None when it has none.

    Raises:
        ValueError: a line is not ``<sha256>  <file>``.
    """
    try:
        with open(os.path.join(checkpoint_dir, MANIFEST)) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return None
    entries = {}
    for number, line in enumerate(lines, 1):
        match = re.fullmatch(r"([0-9a-f]{64}) [ *](.+)", line)
        if not match:
            raise ValueError(f"line {number} is not '<sha256>  <file>': {line[:80]!r}")
        entries[match.group(2)] = match.group(1)
    return entries


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def require_synchronous_saves(engine) -> None:
    """Raises CheckpointError when ``engine`` writes its checkpoints in the background.

    A decoupled checkpoint engine is still writing when ``save_checkpoint`` returns: hashing the files
    then, and pointing ``latest`` at them, would vouch for files not yet whole. ``save_checkpoint``
    checks this itself; a script can call it at its start to fail before it trains.
    """
    if engine.checkpoint_engine.is_decoupled():
        raise CheckpointError(
            "the ds_config's checkpoint engine writes in the background (decoupled); ds_comet.checkpoints "
            "marks a checkpoint whole when engine.save_checkpoint has returned on every rank, which needs "
            "a synchronous engine"
        )


def check_writable(save_dir: str) -> None:
    """Raises CheckpointError unless files can be written in ``save_dir`` (made if missing).

    Not collective: a script calls it on every rank before it trains, so that a save directory it
    cannot write is refused then, by name, not at the first save.
    """
    try:
        os.makedirs(save_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=save_dir, prefix=".write_check_"):  # removed when closed
            pass
    except OSError as error:
        raise CheckpointError(f"checkpoints cannot be written to {save_dir}: {error}") from None


def _check_tag(tag: str):
    if not tag or os.sep in tag or tag in (".", "..", LATEST) or tag.endswith((STAGING_SUFFIX, REPLACED_SUFFIX)):
        raise ValueError(
            f"checkpoint tag {tag!r}: a tag is a plain directory name, not {LATEST!r} and not ending in "
            f"{STAGING_SUFFIX!r} or {REPLACED_SUFFIX!r}"
        )


def save_checkpoint(
    engine,
    save_dir: str,
    tag: str,
    client_state: Mapping[str, Any] | None = None,
    run_shape: Mapping[str, Any] | None = None,
) -> SavedCheckpoint:
    """Saves the engine's checkpoint ``tag`` with its manifest; points ``latest`` at it once it is whole.

    Collective. DeepSpeed's own ``latest`` (save_latest=True) is written by rank 0 as soon as rank 0
    has written its files, while the other ranks may still be writing theirs; here it names only a
    checkpoint that every rank has written and hashed.

    Args:
        engine: a DeepSpeed engine with a synchronous checkpoint engine (``require_synchronous_saves``).
        save_dir: the save directory (made if missing).
        tag: the checkpoint's name, a directory of ``save_dir``; an earlier checkpoint of that name is
            replaced once the new one is whole.
        client_state: saved with the engine's state, returned by ``load_checkpoint``.
        run_shape: a JSON object, what the checkpoint's files depend on; saved as ``run.json``, and
            compared with the resuming run's by ``load_checkpoint``. None: no ``run.json``.

    Returns:
        SavedCheckpoint: the checkpoint's directory, number of files and bytes (manifest left out).

    Raises:
        DiskFullError: a write ran out of space (the message names the directory and its free space).
        CheckpointError: the engine saves in the background.
        ValueError: ``tag`` is no plain directory name.
    """
    _check_tag(tag)
    require_synchronous_saves(engine)
    staging_dir, checkpoint_dir = os.path.join(save_dir, tag + STAGING_SUFFIX), os.path.join(save_dir, tag)
    what = f"saving checkpoint {tag}"
    with explain_disk_full(save_dir, what):
        _on_rank0(lambda: _clear_staging(staging_dir), what)
        with collectives.peers_named(what):  # DeepSpeed's barriers
            engine.save_checkpoint(
                save_dir, tag=tag + STAGING_SUFFIX, client_state=dict(client_state or {}), save_latest=False
            )
        names = _on_rank0(lambda: _record_run_shape(staging_dir, run_shape), what)
        digests, errors = _shared_sha256(staging_dir, names, what, flush_to_disk=True)
        if errors:
            raise CheckpointError(
                f"checkpoint {tag} in {save_dir}: saved files cannot be hashed: "
                + "; ".join(f"{name} {why}" for name, why in sorted(errors.items()))
            )
        size = _on_rank0(lambda: _put_in_place(save_dir, tag, digests), what)
    return SavedCheckpoint(checkpoint_dir, len(names), size)


def _clear_staging(staging_dir: str):
    shutil.rmtree(staging_dir, ignore_errors=True)  # what an earlier save that failed left
    if os.path.lexists(staging_dir):
        raise OSError(f"{staging_dir}, left by an earlier save, cannot be removed: remove it")


def _record_run_shape(staging_dir: str, run_shape: Mapping[str, Any] | None) -> list[str]:
    """Writes ``run.json`` (when there is a shape) and returns the checkpoint's files."""
    if run_shape is not None:
        _write_atomically(os.path.join(staging_dir, RUN_SHAPE), json.dumps(dict(run_shape), indent=1))
    return _checkpoint_files(staging_dir)


def _put_in_place(save_dir: str, tag: str, digests: dict[str, str]) -> int:
    """Writes the manifest, swaps the staged directory in for ``tag``, then points ``latest`` at it.

    Returns the bytes of the checkpoint's files."""
    staging_dir, checkpoint_dir = os.path.join(save_dir, tag + STAGING_SUFFIX), os.path.join(save_dir, tag)
    names = sorted(digests)
    _write_atomically(os.path.join(staging_dir, MANIFEST), "".join(f"{digests[name]}  {name}\n" for name in names))
    replaced = checkpoint_dir + REPLACED_SUFFIX
    if os.path.isdir(checkpoint_dir):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(checkpoint_dir, replaced)
    os.replace(staging_dir, checkpoint_dir)
    _write_atomically(os.path.join(save_dir, LATEST), tag)  # also makes the renames durable
    shutil.rmtree(replaced, ignore_errors=True)
    return sum(os.path.getsize(os.path.join(checkpoint_dir, name)) for name in names)


# --------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------


def find_checkpoint(save_dir: str, tag: str | None = None) -> str:
    """The checkpoint to resume from: ``tag``, or the one ``latest`` names.

    Reads the filesystem only (no collective), so a script can call it before it starts its process
    group; it does not check the files (``load_checkpoint`` does).

    Args:
        save_dir: the save directory.
        tag: a checkpoint of it; None for the one ``latest`` names.

    Returns:
        The tag, a directory of ``save_dir``.

    Raises:
        CheckpointNotFoundError: ``save_dir`` does not exist, has no ``latest`` (and no tag was
            given), or has no directory ``tag``; the message lists the checkpoints there, and names
            ``<tag>.replaced`` when a run stopped while a save replaced ``tag``. Also when
            ``latest`` holds no text (``read_latest``).
    """
    if not os.path.isdir(save_dir):
        raise CheckpointNotFoundError(f"no checkpoint in {save_dir}: the directory does not exist")
    tag = tag or read_latest(save_dir)
    if tag is None:
        raise CheckpointNotFoundError(
            f"no checkpoint in {save_dir}: it has no '{LATEST}' file, which a save writes once the checkpoint is whole"
        )
    if os.path.isdir(os.path.join(save_dir, tag)):
        return tag
    present = sorted(name for name in os.listdir(save_dir) if os.path.isdir(os.path.join(save_dir, name)))
    hint = ""
    if tag + REPLACED_SUFFIX in present:  # a run stopped between a save's two renames
        hint = (
            f"; {tag + REPLACED_SUFFIX} is its earlier copy, which a save was replacing when the run "
            f"stopped: rename it to {tag} to resume from it"
        )
    raise CheckpointNotFoundError(f"no checkpoint {tag} in {save_dir} (there: {', '.join(present) or 'none'}){hint}")


def checkpoint_problems(save_dir: str, tag: str) -> list[str]:
    """What is wrong with checkpoint ``tag`` (collective: every rank gets the list).

    Returns:
        One message per damaged or missing file, or one for a missing or unreadable manifest; empty
        when every file the manifest lists matches its sha256.
    """
    checkpoint_dir = os.path.join(save_dir, tag)

    def manifest_or_problem():
        try:
            manifest = read_manifest(checkpoint_dir)
        except (OSError, ValueError) as error:
            return None, f"{tag}/{MANIFEST} cannot be read: {error}"
        if manifest is None:
            return None, f"{tag} has no {MANIFEST}: its save did not finish, or another program wrote it"
        return manifest, None

    where = f"checking checkpoint {tag}"
    manifest, problem = _on_rank0(manifest_or_problem, where)
    if problem:
        return [problem]
    names = sorted(manifest)
    digests, errors = _shared_sha256(checkpoint_dir, names, where)
    problems = []
    for name in names:
        if name in errors:
            problems.append(f"{tag}/{name}: {errors[name]}")
        elif digests[name] != manifest[name]:
            problems.append(f"{tag}/{name}: damaged (its sha256 is not the one {tag}/{MANIFEST} recorded at the save)")
    return problems


def newest_intact_checkpoint(save_dir: str, skip: str | None = None) -> str | None:
    """The newest checkpoint of ``save_dir`` other than ``skip`` whose files all match its manifest (collective).

    Newest: the largest number a tag ends in (``step20`` before ``step5``), then the latest manifest.
    Directories ending in ``.saving`` or ``.replaced`` are not candidates.

    Returns:
        Its tag, or None when no checkpoint is intact.
    """

    def candidates():
        ranked = []
        for name in os.listdir(save_dir):
            manifest = os.path.join(save_dir, name, MANIFEST)
            if name == skip or name.endswith((STAGING_SUFFIX, REPLACED_SUFFIX)) or not os.path.isfile(manifest):
                continue
            number = re.search(r"(\d+)$", name)
            ranked.append((int(number.group(1)) if number else -1, os.path.getmtime(manifest), name))
        return [name for *_, name in sorted(ranked, reverse=True)]

    for tag in _on_rank0(candidates, f"looking for an intact checkpoint in {save_dir}"):
        if not checkpoint_problems(save_dir, tag):
            return tag
    return None


def shape_differences(save_dir: str, tag: str, run_shape: Mapping[str, Any]) -> list[str]:
    """How the run that saved checkpoint ``tag`` differs from ``run_shape`` (collective).

    Returns:
        ``"<key> <saved value> (this run: <value>)"`` for each key of ``run_shape`` whose saved value
        differs; empty when none does, and for a checkpoint saved without a ``run.json``.
    """

    def saved_shape():
        try:
            with open(os.path.join(save_dir, tag, RUN_SHAPE)) as handle:
                return json.load(handle)
        except FileNotFoundError:
            return None

    saved = _on_rank0(saved_shape, f"reading {tag}/{RUN_SHAPE}")
    if saved is None:
        return []
    return [
        f"{key} {saved.get(key)} (this run: {value})" for key, value in run_shape.items() if saved.get(key) != value
    ]


def verify_checkpoint(save_dir: str, tag: str, run_shape: Mapping[str, Any] | None = None) -> None:
    """Checks checkpoint ``tag`` against its manifest and, given ``run_shape``, against the run that saved it.

    Collective: every rank raises the same error.

    Raises:
        DamagedCheckpointError: a file is damaged or missing, or the manifest is.
        RunShapeMismatchError: the checkpoint's ``run.json`` differs from ``run_shape``.
    """
    problems = checkpoint_problems(save_dir, tag)
    if problems:
        raise DamagedCheckpointError(save_dir, tag, problems, newest_intact_checkpoint(save_dir, skip=tag))
    differences = shape_differences(save_dir, tag, run_shape) if run_shape is not None else []
    if differences:
        raise RunShapeMismatchError(save_dir, tag, differences)


def load_checkpoint(engine, save_dir: str, tag: str, run_shape: Mapping[str, Any] | None = None, **load_options):
    """Loads checkpoint ``tag`` into ``engine`` once ``verify_checkpoint`` has passed (collective).

    Args:
        engine: the DeepSpeed engine.
        save_dir: the save directory.
        tag: the checkpoint (``find_checkpoint``).
        run_shape: this run's shape, compared with the saved ``run.json``; None: not compared.
        **load_options: passed to ``engine.load_checkpoint`` (``load_optimizer_states``, ...).

    Returns:
        ``(load_path, client_state)`` as ``engine.load_checkpoint`` returns them.

    Raises:
        DamagedCheckpointError, RunShapeMismatchError: as ``verify_checkpoint``.
        CheckpointError: DeepSpeed loaded nothing.
    """
    verify_checkpoint(save_dir, tag, run_shape)
    with collectives.peers_named(f"loading checkpoint {tag}"):  # DeepSpeed's collectives
        load_path, client_state = engine.load_checkpoint(save_dir, tag=tag, **load_options)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed did not load checkpoint {tag} from {save_dir}")
    return load_path, client_state
