"""Atomic writes (issue 30): a model directory, checkpoint or adapters directory is the old one or the new one, never a
mix; a directory holding something else is refused; every write error is a `CheckpointWriteError`; untrusted names.

Kills are simulated in-process: `StagedDirectory.record`, which every write calls after each file (the shards, the
index, config.json, transformers' own files, the tokenizer's), raises after the k-th file, for every k, with the
cleanup a kill would skip turned off (`StagedDirectory._discard`), so the temporary directory stays behind as a killed
writer leaves it (its lock released when its descriptor closes, as the kernel releases a dead process's).

Full disks are real, by one of two mechanisms, each a parameter of `small_disk` (the test id says which ran):
- `tmpfs`: a 32 MiB tmpfs mounted by the test (needs root / CAP_SYS_ADMIN; skipped otherwise), filled with a filler
  file to leave a chosen number of bytes free: writes fail with ENOSPC;
- `rlimit`: the process's RLIMIT_FSIZE lowered for the write (SIGXFSZ ignored): the kernel fails any write past that
  size in a file with EFBIG. It needs nothing, so the scenario runs on every Linux machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mmadapt
from mmadapt import VisionLanguageModel, atomic
from mmadapt.atomic import HOST, CheckpointWriteError, StagedDirectory, TargetExistsError
from mmadapt.cli import main
from mmadapt.data import char_tokenizer
from mmadapt.directory import write_config
from mmadapt.processor import export_processor
from mmadapt.train import checkpoint
from mmadapt.train.checkpoint import OutInUseError, OutLock, latest_checkpoint, load_checkpoint, save_checkpoint
from mmadapt.train.config import LoraSection, RunConfig, StagesSection
from mmadapt.train.export import export
from mmadapt.train.stages import apply_stages, save_adapters
from mmadapt.weights import Checkpoint, hf_config

LLAVA = ("clip", "mlp2x_gelu", "llama")
FORMATS = ["mmadapt", "transformers"]


class Killed(BaseException):
    """A simulated kill: a BaseException, so no `except Exception` on the way handles it."""


def tiny(seed: int) -> VisionLanguageModel:
    torch.manual_seed(seed)
    return mmadapt.build_model(*LLAVA).eval()


@pytest.fixture(scope="module")
def models():
    """Two tiny LLaVA models with different weights: the one already on disk and the one written over it."""
    return tiny(0), tiny(1)


def shard_size(model) -> int:
    """A shard limit that splits the model's weights into about five files."""
    return sum(v.numel() * v.element_size() for v in model.state_dict().values()) // 4


def assert_is(model, directory: Path) -> None:
    loaded = VisionLanguageModel.from_pretrained(directory).state_dict()
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((atomic.TMP, atomic.OLD)))


# ---- kills ------------------------------------------------------------------------------------------------------
def kill_after(monkeypatch, k: int) -> list[str]:
    """From now on, a write dies when it has written k files (before the (k+1)-th is recorded), cleaning nothing up."""
    real_record, recorded = StagedDirectory.record, []

    def record(self, name, digest=None):
        if len(recorded) == k:
            raise Killed(f"killed after {k} files")
        recorded.append(name)
        real_record(self, name, digest)

    monkeypatch.setattr(StagedDirectory, "record", record)
    monkeypatch.setattr(StagedDirectory, "_discard", lambda self: None)
    return recorded


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_write_killed_after_any_file_leaves_the_old_model_or_the_new_never_a_mix(fmt, models, tmp_path, monkeypatch):
    """A sharded model written over another, killed after each of its files in turn: the directory loads as the old
    model every time (the old code mixed new and old shards); the next write removes the leftover; a complete write
    gives the new model and no leftover."""
    old, new = models
    target, shard = tmp_path / "model", shard_size(old)
    old.save_pretrained(target, fmt, processor_export=export_processor, max_shard_size=shard)
    new.save_pretrained(tmp_path / "reference", fmt, processor_export=export_processor, max_shard_size=shard)
    files = len(list((tmp_path / "reference").iterdir()))
    assert files >= 6  # shards, index, config(s): a kill between shards is possible
    for k in range(files):
        recorded = kill_after(monkeypatch, k)
        with pytest.raises(Killed):
            new.save_pretrained(target, fmt, processor_export=export_processor, max_shard_size=shard, overwrite=True)
        monkeypatch.undo()
        assert len(recorded) == k
        assert len(leftovers(tmp_path)) == 1  # this kill's; the one before it was removed by this write
        assert_is(old, target)
    new.save_pretrained(target, fmt, processor_export=export_processor, max_shard_size=shard, overwrite=True)
    assert_is(new, target)
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in (tmp_path / "reference").iterdir())


def test_a_write_killed_between_its_two_renames_is_put_back_by_the_next_reader(models, tmp_path, monkeypatch):
    """Where directories cannot be exchanged atomically (no RENAME_EXCHANGE), the swap is two renames: a kill between
    them leaves the target missing, and the next reader puts the old model back."""
    old, new = models
    target = tmp_path / "model"
    old.save_pretrained(target)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        if Path(src) == target:
            raise Killed("killed after moving the old model aside")

    monkeypatch.setattr(atomic.os, "rename", rename)
    monkeypatch.setattr(StagedDirectory, "_discard", lambda self: None)
    with pytest.raises(Killed):
        new.save_pretrained(target, overwrite=True)
    monkeypatch.undo()
    assert not target.exists() and [n.startswith(atomic.OLD) for n in leftovers(tmp_path)].count(True) == 1
    assert_is(old, target)  # put back by from_pretrained
    new.save_pretrained(target, overwrite=True)
    assert_is(new, target)
    assert leftovers(tmp_path) == []


# ---- what may be written over -----------------------------------------------------------------------------------
def test_a_directory_holding_another_model_or_other_files_is_refused(models, tmp_path):
    old, new = models
    target = tmp_path / "model"
    old.save_pretrained(target, tokenizer=char_tokenizer())
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    assert "tokenizer.json" in before
    for fmt in FORMATS:
        with pytest.raises(TargetExistsError, match=r"already holds a model directory.*overwrite=True"):
            new.save_pretrained(target, fmt, processor_export=export_processor)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    new.save_pretrained(target, overwrite=True)
    assert_is(new, target)
    assert not (target / "tokenizer.json").exists()  # replaced whole: nothing of the old model is kept
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # files that are not a model are never replaced, even when asked
        with pytest.raises(TargetExistsError, match=r"not empty and does not hold a model directory \(it holds "
                                                     r"notes\.txt\)"):
            new.save_pretrained(other, overwrite=overwrite)
    assert [p.name for p in other.iterdir()] == ["notes.txt"] and (other / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(TargetExistsError, match="is a file"):
        new.save_pretrained(tmp_path / "file")
    assert leftovers(tmp_path) == []


def test_mmadapt_export_replaces_a_model_only_with_overwrite(models, tmp_path, capsys):
    old, new = models
    src, dst = tmp_path / "src", tmp_path / "dst"
    new.save_pretrained(src)
    old.save_pretrained(dst)
    assert main(["export", str(src), str(dst)]) == 2
    assert "already holds a model directory" in capsys.readouterr().err
    assert_is(old, dst)
    assert main(["export", str(src), str(dst), "--overwrite"]) == 0
    assert_is(new, dst)
    ckpt = write_checkpoint(tmp_path / "run", 1, old)
    with pytest.raises(TargetExistsError, match="training checkpoint"):
        export(src, ckpt, overwrite=True)  # a checkpoint is not a model directory: never replaced by one
    assert checkpoint.verify_checkpoint(ckpt) is None


# ---- checkpoints: checksums, markers -----------------------------------------------------------------------------
def optimizer_state(model) -> dict:
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return {"optimizer": optimizer.state_dict(), "scheduler": {}}


def write_checkpoint(out: Path, step: int, model, keep: int = 2) -> Path:
    return save_checkpoint(out, step, model_state=model.state_dict(), optimizer_state=optimizer_state(model),
                           trainer_state={"step": step}, config=RunConfig.load(None, [f"train.out={out}"]), keep=keep,
                           extras=lambda directory: write_config(model, directory))


def test_checksums_are_taken_while_writing_with_no_second_pass(models, tmp_path, monkeypatch):
    """The marker's SHA-256 of each file equals the file's; saving never re-reads the checkpoint (`file_sha256`, the
    verifier's read, is not called), so rank 0 spends no separate pass on it while other ranks wait."""
    old, _ = models

    def no_second_pass(path):
        raise AssertionError(f"{path} was read again to hash it")

    monkeypatch.setattr(checkpoint, "file_sha256", no_second_pass)
    path = write_checkpoint(tmp_path, 1, old)
    monkeypatch.undo()
    marker = json.loads((path / "COMPLETE").read_text())
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir() if p.name != "COMPLETE"}
    assert marker == {"step": 1, "files": files}
    assert {"model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml", "config.json"} == set(
        files)
    assert checkpoint.verify_checkpoint(path) is None
    assert torch.equal(load_checkpoint(path)["model"]["projector.linear_1.weight"],
                       old.state_dict()["projector.linear_1.weight"])


@pytest.mark.parametrize("marker, problem", [
    ("{not json", r"marker does not parse or lists no checksums .*unverified"),
    (json.dumps({"step": 2}), r"marker does not parse or lists no checksums .*unverified"),
    (json.dumps({"step": 2, "files": ["model.safetensors"]}), r"lists no checksums .*unverified"),
    (json.dumps({"step": 2, "files": {}}), r"config\.json is not in its COMPLETE marker"),
    (json.dumps({"step": 1, "files": {}}), r"marker is for step 1"),
], ids=["not-json", "no-files", "files-a-list", "files-empty", "other-step"])
def test_a_marker_that_does_not_parse_is_unverified_never_trusted(marker, problem, models, tmp_path, caplog,
                                                                   monkeypatch):
    """The repro of the issue: NaN weights under a marker that does not parse were loaded. Now such a checkpoint is
    skipped by `latest_checkpoint(verify=True)` (what --resume uses), with a warning naming the problem."""
    # a library that configured logging earlier in this process (dictConfig) may have disabled existing loggers
    monkeypatch.setattr(logging.getLogger("mmadapt.loading"), "disabled", False)
    old, _ = models
    write_checkpoint(tmp_path, 1, old)
    newest = write_checkpoint(tmp_path, 2, old)
    weights = load_file(newest / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, newest / "model.safetensors")
    (newest / "COMPLETE").write_text(marker)
    assert latest_checkpoint(tmp_path).name == "step-0000002"  # complete, but not verified
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(tmp_path, verify=True).name == "step-0000001"
    assert "step-0000002" in caplog.text
    assert re.search(problem, checkpoint.verify_checkpoint(newest) or "")


# ---- a real full disk -------------------------------------------------------------------------------------------
@dataclass
class SmallDisk:
    root: Path
    kind: str

    @contextmanager
    def leaving(self, free: int):
        """Inside: a file on `root` can grow by at most `free` more bytes (tmpfs: in all; rlimit: per file)."""
        if self.kind == "tmpfs":
            stats = os.statvfs(self.root)
            filler = self.root / "filler"
            size = stats.f_bavail * stats.f_frsize - free
            with open(filler, "wb") as f:
                for start in range(0, size, 1 << 20):
                    f.write(bytes(min(1 << 20, size - start)))
            try:
                yield
            finally:
                filler.unlink()
            return
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (free, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture(params=["tmpfs", "rlimit"])
def small_disk(request, tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    if request.param == "rlimit":
        pytest.importorskip("resource", reason="RLIMIT_FSIZE needs the resource module (POSIX)")
        yield SmallDisk(root, "rlimit")
        return
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(root)], capture_output=True,
                                 text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the rlimit variant of this test runs instead")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the rlimit variant runs instead")
    try:
        yield SmallDisk(root, "tmpfs")
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30)


def causes(error: BaseException) -> list[str]:
    names = []
    while error is not None:
        names.append(type(error).__name__)
        error = error.__cause__ or error.__context__
    return names


@pytest.mark.parametrize("fails_in", ["model.safetensors", "optimizer.pt"])
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(fails_in, small_disk, models, tmp_path):
    """The safetensors file (safetensors' SafetensorError) or torch.save's file (an OSError) cannot be written: a
    `CheckpointWriteError` naming the checkpoint, no temporary directory left, the previous checkpoint verified and
    equal to what it was."""
    old, new = models
    sizes = {p.name: p.stat().st_size for p in write_checkpoint(tmp_path / "sizes", 1, new).iterdir()}
    assert sizes["optimizer.pt"] > sizes["model.safetensors"] + 3 * 4096  # so the second case fails in the optimizer
    out = small_disk.root / "run"
    previous = write_checkpoint(out, 1, old)
    free = sizes["model.safetensors"] // 2 if fails_in == "model.safetensors" else sizes["model.safetensors"] + 8192
    with small_disk.leaving(free), pytest.raises(CheckpointWriteError) as failure:
        write_checkpoint(out, 2, new)
    message = str(failure.value)
    assert f"could not write checkpoint {out / 'checkpoints' / 'step-0000002'}" in message
    assert ("No space left on device" if small_disk.kind == "tmpfs" else "File too large") in message
    assert "The previous checkpoint step-0000001 is intact" in message
    if fails_in == "model.safetensors":
        assert "SafetensorError" in causes(failure.value) and "model.safetensors" in message
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000001"]  # no step 2, no temporary directory
    assert checkpoint.verify_checkpoint(previous) is None
    saved = load_checkpoint(previous)["model"]
    assert all(torch.equal(saved[k], v) for k, v in old.state_dict().items())
    assert write_checkpoint(out, 2, new).name == "step-0000002"  # with room again, the run goes on


def sharded_writer(out: Path, *, asynchronous: bool):
    from mmadapt.train.saving import CheckpointWriter

    return CheckpointWriter(out, format="sharded", asynchronous=asynchronous, keep=2, is_main=True)


def write_sharded(writer, step: int, model) -> Path:
    """A sharded checkpoint of `model` (AdamW after one step), written and, when asynchronous, waited for."""
    from mmadapt.train.saving import Snapshot

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    snapshot = Snapshot(scheduler={"last_epoch": step}, rng=checkpoint.rng_state(), trainer_state={"step": step},
                        config=RunConfig.load(None, [f"train.out={writer.out}"]),
                        extras=lambda directory: write_config(model, directory))
    path = writer.save(step, wrapped=model, model=model, optimizer=optimizer, snapshot=snapshot)
    return path or writer.wait()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_sharded_checkpoint_keeps_the_previous_one(asynchronous, small_disk, models):
    """The shard file cannot be written (DCP's write, in the background with checkpoint.async): a
    `CheckpointWriteError` naming the checkpoint and the cause, raised where the step loop waits for the save; no
    temporary directory left; the previous checkpoint verified and holding its weights; with room again, the next
    save works."""
    from mmadapt.sharded_checkpoint import ModelTensors

    old, new = models
    out = small_disk.root / "run"
    writer = sharded_writer(out, asynchronous=asynchronous)
    previous = write_sharded(writer, 1, old)
    size = (previous / "state" / "__0_0.distcp").stat().st_size
    with small_disk.leaving(size // 2), pytest.raises(CheckpointWriteError) as failure:
        write_sharded(writer, 2, new)
    message = str(failure.value)
    assert f"could not write checkpoint {out / 'checkpoints' / 'step-0000002'}" in message, message
    assert "The previous checkpoint step-0000001 is intact" in message
    assert sorted(os.listdir(out / "checkpoints")) == ["step-0000001"]
    assert checkpoint.verify_checkpoint(previous) is None
    saved = ModelTensors(previous).read(old.state_dict())
    assert all(torch.equal(saved[k], v) for k, v in old.state_dict().items())
    assert write_sharded(writer, 2, new).name == "step-0000002"
    writer.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_during_an_export_keeps_the_previous_model(fmt, small_disk, models, tmp_path):
    old, new = models
    shard = shard_size(old)
    new.save_pretrained(tmp_path / "new", fmt, processor_export=export_processor, max_shard_size=shard)
    target = small_disk.root / "model"
    old.save_pretrained(target, fmt, processor_export=export_processor, max_shard_size=shard)
    with small_disk.leaving(shard // 2), pytest.raises(CheckpointWriteError) as failure:
        export(tmp_path / "new", target, format=fmt, overwrite=True)
    message = str(failure.value)
    assert f"could not write model directory {target}" in message
    assert "The model directory that was there is intact" in message
    assert_is(old, target)
    assert leftovers(small_disk.root) == []


# ---- the lock on OUT, and the leftovers of other writers --------------------------------------------------------
HOLD_LOCK = """
import fcntl, os, socket, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY if os.path.isdir(path) else os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
if not os.path.isdir(path):
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since just now".encode())
print("locked", flush=True)
time.sleep(60)
"""


@contextmanager
def holding_lock(path: Path):
    """Another process holding `flock` on `path` (a lock file, or a directory) until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tmp_path):
    with holding_lock(tmp_path / ".lock") as other:
        with pytest.raises(OutInUseError, match=rf"{tmp_path} is in use by another run: pid {other.pid} on host "
                                                r".*Fix: wait until it ends, or give this run another train\.out"):
            OutLock.acquire(tmp_path)
    with OutLock.acquire(tmp_path):  # the killed run's lock went with it
        assert f"pid {os.getpid()} on host {HOST}" in (tmp_path / ".lock").read_text()
        with pytest.raises(OutInUseError, match=f"pid {os.getpid()}"):
            OutLock.acquire(tmp_path)  # a second trainer in this very process too
    OutLock.acquire(tmp_path).release()


def test_prune_never_deletes_a_live_writers_temporary_directory(tmp_path):
    root = tmp_path / "checkpoints"
    live = root / f".tmp-step-0000003~{HOST}~{os.getpid() + 1}~0"
    dead = root / ".tmp-step-0000002~elsewhere~4242~0"
    for directory in (live, dead):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"partial")
    with holding_lock(live):
        checkpoint.prune(tmp_path, keep=2)
        assert live.exists() and not dead.exists()
    checkpoint.prune(tmp_path, keep=2)  # its writer is gone now
    assert not live.exists()


# ---- adapters ---------------------------------------------------------------------------------------------------
def lora_model(seed: int):
    model = tiny(seed)
    apply_stages(model, StagesSection(preset="lora"), LoraSection(r=2, alpha=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    return model


def test_adapters_are_written_whole_and_replaced_only_when_asked(tmp_path, monkeypatch):
    old, new = lora_model(0), lora_model(1)
    modes = {"encoder": "frozen", "projector": "full", "backbone": "lora"}
    target = tmp_path / "adapters"
    assert save_adapters(old, target, modes) == [str(target / "backbone")]
    before = load_file(target / "backbone" / "adapter_model.safetensors")
    with pytest.raises(TargetExistsError, match=r"already holds a LoRA adapters directory.*overwrite=True"):
        save_adapters(new, target, modes)
    kill_after(monkeypatch, 1)
    with pytest.raises(Killed):
        save_adapters(new, target, modes, overwrite=True)
    monkeypatch.undo()
    kept = load_file(target / "backbone" / "adapter_model.safetensors")
    assert all(torch.equal(kept[k], v) for k, v in before.items())
    save_adapters(new, target, modes, overwrite=True)
    written = load_file(target / "backbone" / "adapter_model.safetensors")
    assert not all(torch.equal(written[k], v) for k, v in before.items())
    assert json.loads((target / "stages.json").read_text())["stages"] == modes
    assert leftovers(tmp_path) == []


# ---- names and code from elsewhere ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/hosts", "sub/model.safetensors", "..", "", 7])
def test_an_index_naming_a_file_outside_its_directory_is_refused(name, models, tmp_path):
    old, _ = models
    target = tmp_path / "model"
    old.save_pretrained(target, max_shard_size=shard_size(old))
    index = json.loads((target / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json names weight files that are not plain file "
                                         r"names inside its directory: .*no '/', '\.\.' or absolute path"):
        VisionLanguageModel.from_pretrained(target)
    with pytest.raises(ValueError, match="not plain file names"):
        Checkpoint.open(target)


def test_a_config_that_needs_its_own_code_is_refused_and_the_code_never_runs(tmp_path):
    ran = tmp_path / "ran"
    (tmp_path / "configuration_evil.py").write_text(
        f"open({str(ran)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil_vlm'\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil_vlm",
                                                      "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}))
    save_file({"weight": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"describes its architecture with its own Python code .*never runs code "
                                         r"from a model directory \(trust_remote_code=False\)"):
        hf_config(Checkpoint.open(tmp_path), "backbone 'llama'")
    assert not ran.exists()
