"""The regions file: each model's pieces and source shapes beside the manifest, expert
runs folded into ranges, read only when a loader serves another topology."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardprep.constants import REGIONS_NAME
from shardprep.convert.run import Options, convert
from shardprep.errors import ManifestError
from shardprep.format.manifest import PieceEntry, ScaleEntry, read_manifest, read_regions
from shardprep.format.regions import parse_regions, regions_document

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardprep.demo.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("regions")
    model = make_tiny_model(root / "model", "Qwen3MoeForCausalLM", num_experts=8)
    convert(str(model), root / "out", Options(tp=2, pp=2), progress=False)
    return root / "out"


def test_the_manifest_names_the_regions_file_and_holds_no_piece(artifact: Path) -> None:
    core = json.loads((artifact / "shardprep.json").read_text())
    raw = (artifact / REGIONS_NAME).read_bytes()
    assert core["regions"]["sha256"] == hashlib.sha256(raw).hexdigest()
    assert core["regions"]["bytes"] == len(raw)
    assert all("pieces" not in m and "source_shapes" not in m for m in core["models"])
    manifest = read_manifest(artifact)
    assert manifest.served_tps == (1, 2)
    assert REGIONS_NAME in {e.path for e in manifest.side_files}


def test_expert_pieces_are_written_as_ranges(artifact: Path) -> None:
    regions = json.loads((artifact / REGIONS_NAME).read_text())
    (target,) = regions["models"]
    stacks = [items for name, items in target["pieces"].items() if "experts.w13" in name]
    assert stacks and all(len(items) == 1 for items in stacks)
    (run,) = stacks[0]
    assert run["experts"] == [0, 8]
    assert [p[0].rsplit(".", 3)[-3:] for p in run["each"]] == [
        ["{e}", "gate_proj", "weight"],
        ["{e}", "up_proj", "weight"],
    ]
    assert all("experts.{e}." in entry[0] for entry in target["expert_shapes"])


def test_read_regions_gives_back_every_piece(artifact: Path, tmp_path: Path) -> None:
    """The pieces the plan made, one per expert, equal what the regions file unfolds to."""
    manifest = read_regions(artifact, read_manifest(artifact))
    (target,) = manifest.models
    w13 = target.pieces["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert [p.expert for p in w13] == [e for e in range(8) for _ in range(2)]
    assert w13[3].source == "model.layers.0.mlp.experts.1.up_proj.weight"
    assert all(p.source in target.source_shapes for ps in target.pieces.values() for p in ps)
    # written again, the same bytes
    assert regions_document(manifest.models) == (artifact / REGIONS_NAME).read_bytes()


PIECE = st.builds(
    PieceEntry,
    source=st.sampled_from(["a.0.w", "m.layers.1.experts.1.w1", "x.{e}.y", "b.2.c.2"]),
    cut=st.sampled_from(["rows", "cols", "replicate"]),
    expert=st.one_of(st.none(), st.integers(0, 4)),
)


@FUZZ
@given(st.lists(PIECE, min_size=1, max_size=12))
def test_any_pieces_round_trip_through_the_regions_file(pieces: list[PieceEntry]) -> None:
    """Folding never changes what unfolds: ranges only where they give the same pieces."""
    from shardprep.format.records import ModelEntry, Source

    shapes = {p.source: (4, 4) for p in pieces}
    model = ModelEntry(
        "target", "X", "BF16", "", 1, Source("m", None, None, ()),
        pieces={"p": tuple(pieces)}, source_shapes=shapes,
    )  # fmt: skip
    assert parse_regions(regions_document([model])) == {"target": ({"p": tuple(pieces)}, shapes)}


def test_a_fused_gqa_qkv_piece_keeps_its_query_and_kv_heads() -> None:
    from shardprep.format.records import ModelEntry, Source

    piece = PieceEntry("qkv", "qkv_heads", heads=2, q_heads=8)
    model = ModelEntry(
        "target", "X", "BF16", "", 1, Source("m", None, None, ()),
        pieces={"p": (piece,)}, source_shapes={"qkv": (36, 4)},
    )  # fmt: skip
    document = regions_document([model])
    assert b'["qkv","qkv_heads",{"heads":2,"q_heads":8}]' in document
    assert parse_regions(document) == {"target": ({"p": (piece,)}, {"qkv": (36, 4)})}


def test_a_run_of_experts_with_a_scale_folds_with_it() -> None:
    from shardprep.format.records import ModelEntry, Source

    scale = ScaleEntry((8, 8), "rows", (2, 2))
    pieces = tuple(
        PieceEntry(f"l.3.experts.{e}.{w}", cut, 0, e, scale if cut == "block_scale" else None)
        for e in range(5)
        for w, cut in (("w", "rows"), ("s", "block_scale"))
    )
    model = ModelEntry(
        "target", "X", "BF16", "", 1, Source("m", None, None, ()), pieces={"p": pieces},
        source_shapes={p.source: (8, 8) if p.cut == "rows" else (4, 4) for p in pieces},
    )  # fmt: skip
    raw = regions_document([model])
    assert len(json.loads(raw)["models"][0]["pieces"]["p"]) == 1
    assert parse_regions(raw)["target"] == (model.pieces, model.source_shapes)


def _copy(artifact: Path, tmp_path: Path, edit) -> Path:
    """The artifact with its regions file edited, and the manifest naming the new bytes."""
    folder = tmp_path / "copy"
    shutil.copytree(artifact, folder)
    data = json.loads((folder / REGIONS_NAME).read_text())
    edit(data)
    raw = json.dumps(data).encode()
    (folder / REGIONS_NAME).write_bytes(raw)
    core = json.loads((folder / "shardprep.json").read_text())
    core["regions"].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    (folder / "shardprep.json").write_text(json.dumps(core))
    return folder


def _target(data: dict) -> dict:
    return data["models"][0]


def _first_range(data: dict) -> dict:
    return next(i for v in _target(data)["pieces"].values() for i in v if isinstance(i, dict))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="x"), "regions.format must be one of"),
        (lambda d: _target(d).update(role="draft"), "holds the pieces of ['draft'], the manif"),
        (lambda d: _target(d)["pieces"].popitem(), "have no pieces"),
        (lambda d: _target(d)["expert_shapes"].pop(), "of no recorded shape"),
        (lambda d: _first_range(d).update(experts=[3, 3]), "a range [first, stop) of experts"),
        (lambda d: _first_range(d).update(experts=[0, 9]), "stop at most 8 (the model's"),
        (lambda d: _target(d)["expert_shapes"][0].__setitem__(2, 9), "stop at most 8"),
        (lambda d: _first_range(d)["each"][0].__setitem__(0, "x"), "names {e}, not an expert"),
        (lambda d: _target(d)["expert_shapes"][0].__setitem__(2, 0), "a range [first, stop)"),
        (lambda d: d["models"].append(d["models"][0]), "lists the target twice"),
    ],
)
def test_each_flaw_of_the_regions_file_is_named(
    artifact: Path, tmp_path: Path, edit, message: str
) -> None:
    folder = _copy(artifact, tmp_path, edit)
    started = time.monotonic()
    with pytest.raises(ManifestError) as info:
        read_regions(folder, read_manifest(folder))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - started < 2


def test_a_regions_file_that_is_not_the_recorded_one_is_refused(
    artifact: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(artifact, folder)
    raw = bytearray((folder / REGIONS_NAME).read_bytes())
    raw[10] ^= 1
    (folder / REGIONS_NAME).write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="does not match the sha256 the manifest records"):
        read_regions(folder, read_manifest(folder))
    (folder / REGIONS_NAME).unlink()
    with pytest.raises(ManifestError, match="lacks shardprep.regions.json, which the manifest"):
        read_regions(folder, read_manifest(folder))


def test_an_inline_manifest_reads_as_before(artifact: Path, tmp_path: Path) -> None:
    """An artifact made before the regions file (pieces inline) serves other tps still."""
    manifest = read_regions(artifact, read_manifest(artifact))
    legacy = dataclasses.replace(manifest, regions=None)
    folder = tmp_path / "legacy"
    shutil.copytree(artifact, folder)
    (folder / REGIONS_NAME).unlink()
    (folder / "shardprep.json").write_text(legacy.to_json())
    again = read_manifest(folder)
    assert again.regions is None and again.served_tps == (1, 2)
    assert read_regions(folder, again).models == manifest.models


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_give_regions_or_a_manifest_error(raw: bytes) -> None:
    with contextlib.suppress(ManifestError):
        parse_regions(raw, max_experts=8)


def _near_valid(artifact: Path) -> st.SearchStrategy[bytes]:
    def mutate(data: dict, path: list, value: object) -> bytes:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return json.dumps(data).encode()

    base = json.loads((artifact / REGIONS_NAME).read_text())
    paths = []

    def walk(node: object, path: list) -> None:
        paths.append(path)
        if isinstance(node, (dict, list)):
            children = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in list(children)[:6]:
                walk(child, [*path, key])

    walk(base, [])
    values = st.one_of(
        st.none(), st.integers(-3, 2**50), st.text(max_size=8), st.just([]), st.just({}),
        st.just([0, 2**20]), st.just("{e}"),
    )  # fmt: skip
    return st.builds(
        lambda path, value: mutate(json.loads(json.dumps(base)), path, value),
        st.sampled_from([p for p in paths if p]),
        values,
    )


@FUZZ
@given(data=st.data())
def test_near_valid_regions_give_regions_or_a_manifest_error(
    artifact: Path, data: st.DataObject
) -> None:
    raw = data.draw(_near_valid(artifact))
    tracemalloc.start()
    try:
        parse_regions(raw, max_experts=8)
    except ManifestError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * 1024**2
