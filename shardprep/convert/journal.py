"""The journal that makes a conversion resumable.

`.shardprep-partial.json` in the output folder records which rank files are complete, with
their sha256, for one exact plan (a fingerprint of the plan and of the source files' sizes
and times). A rerun skips the files that still hash to what it recorded. A complete
artifact (its manifest present) is treated the same way, if it is this plan's.

It is JSON lines: the plan first, then one line per finished file, appended as each file
is renamed into place. Appending costs one small write; rewriting the whole record
through a rename each time took 15 ms a file on ext4 while the conversion's own writes
were in flight, on the threads that hash. A last line without its newline is a write
that was cut short, and is ignored.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardprep import safefs
from shardprep.constants import LOCK_NAME, MANIFEST_NAME, PARTIAL_MARKER, SOURCE_DOWNLOAD_DIR
from shardprep.convert.checkpoint import Checkpoint, known_sha256
from shardprep.errors import CorruptFileError, OutputExistsError
from shardprep.format import manifest as mf
from shardprep.hashing import sha256_file
from shardprep.plan.records import ExpertPlan, Plan


@dataclass
class Journal:
    """`.shardprep-partial.json`: which rank files are complete, for this exact plan."""

    path: Path
    fingerprint: str
    done: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(
        cls, out: Path, fingerprint: str, plan: Plan, checkpoints: dict[str, Checkpoint]
    ) -> Journal:
        path = out / PARTIAL_MARKER
        done: dict[str, str] = {}
        # A manifest is compared whatever the journal says: a rerun over a complete
        # artifact that failed or was stopped leaves its journal beside it.
        if (out / MANIFEST_NAME).is_file():
            previous = mf.read_manifest(out)
            _check_same_plan(out, previous, plan, checkpoints, fingerprint)
            done = {f.path: f.sha256 for f in previous.files}
        if path.is_file():
            return cls.resume(path, out, fingerprint, done)
        if done:
            journal = cls(path, fingerprint, done)
            journal._save()
            return journal
        if out.exists() and any(
            p.name not in (LOCK_NAME, SOURCE_DOWNLOAD_DIR) for p in out.iterdir()
        ):
            raise OutputExistsError(
                f"{out} already holds files that are not a shardprep artifact; "
                "choose an empty or new output folder"
            )
        out.mkdir(parents=True, exist_ok=True)
        journal = cls(path, fingerprint)
        journal._save()
        return journal

    @classmethod
    def resume(
        cls, path: Path, out: Path, fingerprint: str, kept: dict[str, str] | None = None
    ) -> Journal:
        """The journal at `path`, written anew before anything is appended to it: this
        plan's line first (another plan's records dropped), no line cut short. `kept`:
        the files of this plan's manifest, which a rerun need not write again either."""
        state = _read_state(path, out)
        done = state["done"] if state["plan"] == fingerprint else {}
        journal = cls(path, fingerprint, {**(kept or {}), **done})
        journal._save()
        return journal

    def verified_files(self, out: Path) -> set[str]:
        """Files the journal lists whose bytes still hash to what it recorded."""
        return {p for p, digest in self.done.items() if _hash_matches(out / p, digest)}

    def record(self, path: str, digest: str) -> None:
        with self.lock:
            self.done[path] = digest
            try:
                safefs.append_existing(self.path, _line({"path": path, "sha256": digest}))
            except OSError:  # removed or replaced by a link meanwhile: written anew
                self._save()

    def _save(self) -> None:
        lines = [_line({"plan": self.fingerprint})]
        lines += [_line({"path": p, "sha256": d}) for p, d in sorted(self.done.items())]
        safefs.write_atomic(self.path, "".join(lines))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _line(entry: dict[str, str]) -> str:
    return json.dumps(entry) + "\n"


def _read_state(path: Path, out: Path) -> dict[str, Any]:
    """The journal's content, or one line saying how to start over."""
    state = parse_journal(path.read_bytes())
    if state is None:
        raise CorruptFileError(
            f"{path}, the record of an interrupted convert, is damaged; to start over, "
            f"delete the folder {out} and run the same convert again",
            path=str(path),
        )
    return state


def parse_journal(data: bytes) -> dict[str, Any] | None:
    """`{"plan": ..., "done": {path: sha256}}` from a journal's bytes; None if damaged.
    Also reads the single JSON object that earlier versions wrote."""
    try:
        whole = json.loads(data)
    except (ValueError, RecursionError):
        whole = None
    try:
        if isinstance(whole, dict) and "done" in whole:
            plan, done = whole["plan"], whole["done"]
        else:
            lines = [json.loads(line) for line in data.split(b"\n")[:-1]]
            plan = lines[0]["plan"]
            done = {entry["path"]: entry["sha256"] for entry in lines[1:]}
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    valid = (
        isinstance(plan, str)
        and isinstance(done, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in done.items())
    )
    return {"plan": plan, "done": done} if valid else None


def _check_same_plan(
    out: Path,
    previous: mf.Manifest,
    plan: Plan,
    checkpoints: dict[str, Checkpoint],
    fingerprint: str,
) -> None:
    """A complete artifact is re-verified and kept only if it is this very plan's: the
    fingerprint the manifest recorded, else (an artifact made before it was recorded)
    every field the manifest holds of the plan and its sources."""
    if previous.plan_fingerprint == fingerprint:
        return
    differences = plan_differences(previous, plan, checkpoints)
    if not differences and previous.plan_fingerprint is None:
        return
    if not differences:
        differences = ["a source file's size or modification time changed since"]
    raise OutputExistsError(
        f"{out} holds a shardprep artifact of another model or topology "
        f"({'; '.join(differences[:3])}); choose a new output folder or delete that one"
    )


def plan_differences(
    previous: mf.Manifest, plan: Plan, checkpoints: dict[str, Checkpoint]
) -> list[str]:
    """What the manifest records differently from this plan and its sources, in words."""
    found = []
    topo, new = previous.topology, plan.topology
    if (topo.tp, topo.pp, topo.partition) != (new.tp, new.pp, new.partition):
        found.append(f"tp{topo.tp} x pp{topo.pp} {list(topo.partition)}, not "
                     f"tp{new.tp} x pp{new.pp} {list(new.partition)}")  # fmt: skip
    asked = any(m.experts is not None and m.experts.split.expert_parallel for m in plan.models)
    if topo.expert_parallel != asked:
        found.append(f"expert parallelism {_on(topo.expert_parallel)}, not {_on(asked)}")
    if previous.stages != plan.stages:
        found.append(f"stages {list(previous.stages)}, not {list(plan.stages)}")
    if sorted(f.path for f in previous.files) != sorted(f.path for f in plan.files):
        found.append("other rank files")
    for model in plan.models:
        entry = previous.model(model.role)
        if entry is None:
            found.append(f"no {model.role} model")
            continue
        if entry.dtype != model.dtype:
            found.append(f"{model.role} dtype {entry.dtype}, not {model.dtype}")
        if entry.experts is not None and model.experts is not None:
            found += _expert_differences(model.role, entry.experts, model.experts)
        found += _source_differences(model.role, entry.source, checkpoints[model.role])
    planned = {model.role for model in plan.models}
    found += [f"a {m.role} model, not none" for m in previous.models if m.role not in planned]
    return found


def _expert_differences(role: str, recorded: mf.Experts, planned: ExpertPlan) -> list[str]:
    pairs = (
        ("dp", recorded.dp, planned.split.dp),
        ("expert placement", recorded.requested_placement, planned.requested_placement),
    )
    return [f"{role} {name} {old}, not {new}" for name, old, new in pairs if old != new]


def _on(value: bool) -> str:
    return "on" if value else "off"


def _source_differences(role: str, source: mf.Source, checkpoint: Checkpoint) -> list[str]:
    recorded = {f.path: f for f in source.files}
    if checkpoint.repo_id and (source.repo_id, source.revision) != (
        checkpoint.repo_id,
        checkpoint.revision,
    ):
        return [f"{role} source {source.repo_id}@{source.revision}"]
    if not checkpoint.repo_id and source.model != str(checkpoint.root.resolve()):
        return [f"{role} source {source.model}"]
    if sorted(recorded) != sorted(checkpoint.files):
        return [f"{role} source files {sorted(recorded)[:3]}"]
    for name in checkpoint.files:
        size = checkpoint.size(name)
        known = known_sha256(checkpoint, name)
        entry = recorded[name]
        if entry.bytes != size or (known and entry.sha256 and known.sha256 != entry.sha256):
            return [f"{role} source file {name} changed"]
    return []


def _hash_matches(path: Path, digest: str) -> bool:
    """A regular file (a link is never kept: it is rewritten) that hashes to `digest`."""
    return not path.is_symlink() and path.is_file() and sha256_file(path) == digest


def fingerprint(plan: Plan, checkpoints: dict[str, Checkpoint]) -> str:
    """Changes whenever the plan (dtype, every tensor and file) or the sources' identity
    changes: their folder or repo and revision, each file's size, time and known sha256
    (a Hub source's commit and sha256 name its bytes: no time, and a file of another stage
    need not be here)."""
    stats = {
        f"{role}/{f}": [
            cp.size(f),
            None if cp.remote else (cp.root / f).stat().st_mtime_ns,
            known.sha256 if (known := known_sha256(cp, f)) else None,
        ]
        for role, cp in checkpoints.items()
        for f in (*cp.files, *cp.side_files())
    }
    where = {
        role: [cp.repo_id, cp.revision, None if cp.repo_id else str(cp.root.resolve())]
        for role, cp in checkpoints.items()
    }
    text = json.dumps([repr(plan), stats, where], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()
