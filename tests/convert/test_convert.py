"""Converting tiny real checkpoints: bytes, resume, determinism and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardprep.constants import MANIFEST_NAME, PARTIAL_MARKER
from shardprep.convert import rankfiles as rankfiles_module
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.quant_configs import TINY_MXFP4, TINY_NVFP4
from shardprep.demo.tiny import TINY_FP8, make_tiny_model
from shardprep.errors import ConfigError, CorruptFileError, OutputExistsError, PlanError
from shardprep.format.manifest import read_manifest

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("tp", "pp"), TOPOLOGIES)
def test_every_arch_and_topology_round_trips(tiny, tmp_path: Path, arch: str, tp: int, pp: int):
    model = tiny.model(arch, arch)
    manifest = convert(str(model), tmp_path / "out", Options(tp=tp, pp=pp), progress=False)
    assert len({(f.pp, f.tp) for f in manifest.files}) == tp * pp
    report = verify(tmp_path / "out", full=True)
    assert report.ok, report.problems
    assert report.round_trip_tensors == len(load_file(model / "model.safetensors"))


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("DeepseekV3ForCausalLM", {"quantization_config": TINY_FP8, "num_nextn_predict_layers": 1}),
        ("DeepseekV4ForCausalLM", {}),
        ("GptOssForCausalLM", {"quantization_config": TINY_MXFP4}),
        ("KimiK3ForConditionalGeneration", {"num_nextn_predict_layers": 1}),
        ("Qwen3_5MoeForConditionalGeneration", {}),
        ("Qwen3MoeForCausalLM", {"quantization_config": TINY_NVFP4}),
    ],
    ids=["deepseek-v3-fp8", "deepseek-v4", "gpt-oss-mxfp4", "kimi-k3", "qwen3.5-moe", "nvfp4"],
)
def test_the_newer_families_round_trip(tmp_path: Path, arch: str, overrides: dict) -> None:
    """`verify --full` re-cuts every block from the source: fp8 expert scales on a refined
    grid (one scale row per expert), MXFP4 slabs, fused expert stacks, drafts."""
    model = make_tiny_model(tmp_path / "model", arch, **overrides)
    convert(str(model), tmp_path / "out", Options(tp=2, pp=2), progress=False)
    report = verify(tmp_path / "out", full=True)
    assert report.ok, report.problems[:3]
    assert report.round_trip_tensors > 0


def test_fused_qkv_bytes_equal_an_independent_cut(tiny, tmp_path: Path) -> None:
    model = tiny.model("qwen2-kv1", "Qwen2ForCausalLM", num_key_value_heads=1)
    convert(str(model), tmp_path / "out", Options(tp=4, pp=1, dtype="float32"), progress=False)
    source = load_file(model / "model.safetensors")
    prefix = "model.layers.1.self_attn."
    for rank in range(4):
        got = load_file(tmp_path / f"out/shards/model-pp-0-tp-{rank}-part-0.safetensors")
        q = source[prefix + "q_proj.weight"].chunk(4)[rank]
        k, v = source[prefix + "k_proj.weight"], source[prefix + "v_proj.weight"]  # 1 KV head
        assert torch.equal(got[prefix + "qkv_proj.weight"], torch.cat([q, k, v]))
        qb = source[prefix + "q_proj.bias"].chunk(4)[rank]
        bias = torch.cat([qb, source[prefix + "k_proj.bias"], source[prefix + "v_proj.bias"]])
        assert torch.equal(got[prefix + "qkv_proj.bias"], bias)
        down = source["model.layers.1.mlp.down_proj.weight"].chunk(4, dim=1)[rank]
        assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], down)


def test_vocab_32001_is_padded_with_zero_rows(tiny, tmp_path: Path) -> None:
    model = tiny.model("vocab-32001", vocab_size=32001, tie_word_embeddings=True)
    convert(str(model), tmp_path / "out", Options(tp=2, pp=2, dtype="float32"), progress=False)
    embed = load_file(model / "model.safetensors")["model.embed_tokens.weight"]
    last = load_file(tmp_path / "out/shards/model-pp-1-tp-1-part-0.safetensors")
    rank1 = last["model.embed_tokens.weight"]  # tied: the last stage holds it too
    assert rank1.shape == (16032, 128)
    assert torch.equal(rank1[: 32001 - 16032], embed[16032:])
    assert not rank1[32001 - 16032 :].any()
    assert "lm_head.weight" not in last
    assert verify(tmp_path / "out", full=True).ok


def test_bf16_source_cast_to_float32(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", torch_dtype="bfloat16")
    convert(str(model), tmp_path / "out", Options(tp=2, pp=1, dtype="float32"), progress=False)
    got = load_file(tmp_path / "out/shards/model-pp-0-tp-0-part-0.safetensors")
    assert {t.dtype for t in got.values()} == {torch.float32}
    source = load_file(model / "model.safetensors")["model.norm.weight"]
    assert torch.equal(got["model.norm.weight"], source.float())
    assert verify(tmp_path / "out", full=True).ok


def test_sharded_index_and_shuffled_order_give_identical_bytes(tmp_path: Path) -> None:
    one = make_tiny_model(tmp_path / "one", files=1)
    three = make_tiny_model(tmp_path / "three", files=3)
    index = json.loads((three / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict(reversed(list(index["weight_map"].items())))
    (three / "model.safetensors.index.json").write_text(json.dumps(index))
    a = convert(str(one), tmp_path / "a", Options(tp=2, pp=2), progress=False)
    b = convert(str(three), tmp_path / "b", Options(tp=2, pp=2), progress=False)
    assert [(f.path, f.sha256) for f in a.files] == [(f.path, f.sha256) for f in b.files]


def test_stage_converts_one_stage_only(tiny, tmp_path: Path) -> None:
    model = tiny.model("llama-5", num_hidden_layers=5)
    manifest = convert(str(model), tmp_path / "out", Options(tp=2, pp=2, stage=1), progress=False)
    assert manifest.stages == (1,)
    assert {f.pp for f in manifest.files} == {1}
    assert not list((tmp_path / "out/shards").glob("model-pp-0-*"))
    assert verify(tmp_path / "out", full=True).ok


def test_explicit_partition_from_env(tiny, tmp_path: Path, monkeypatch) -> None:
    model = tiny.model("llama-5", num_hidden_layers=5)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,4")
    manifest = convert(str(model), tmp_path / "out", Options(tp=1, pp=2), progress=False)
    assert manifest.topology.partition == (1, 4)
    first = load_file(tmp_path / "out/shards/model-pp-0-tp-0-part-0.safetensors")
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0"}


def test_interrupted_conversion_resumes_and_skips_finished_files(tiny, tmp_path, monkeypatch):
    model = tiny.model("llama")
    out = tmp_path / "out"
    real_commit = rankfiles_module._commit
    calls = []

    def flaky_commit(handle, journal):
        calls.append(handle.plan.path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_commit(handle, journal)

    monkeypatch.setattr(rankfiles_module, "_commit", flaky_commit)
    with pytest.raises(KeyboardInterrupt):
        convert(str(model), out, Options(tp=2, pp=2), progress=False)
    assert not (out / MANIFEST_NAME).exists()
    assert (out / PARTIAL_MARKER).exists()
    assert not list(out.rglob("*.incomplete"))
    finished = {p: (out / p).stat().st_mtime_ns for p in calls[:2]}

    monkeypatch.setattr(rankfiles_module, "_commit", real_commit)
    manifest = convert(str(model), out, Options(tp=2, pp=2), progress=False)
    assert {p: (out / p).stat().st_mtime_ns for p in finished} == finished
    assert not (out / PARTIAL_MARKER).exists()
    assert len(manifest.files) == 4 and verify(out, full=True).ok


def test_rerun_over_a_complete_artifact_repairs_a_damaged_file(tiny, tmp_path: Path) -> None:
    model = tiny.model("llama")
    out = tmp_path / "out"
    first = convert(str(model), out, Options(tp=2, pp=1), progress=False)
    damaged = out / first.files[1].path
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(data)
    assert not verify(out).ok
    again = convert(str(model), out, Options(tp=2, pp=1), progress=False)
    assert again.files == first.files and verify(out).ok


def test_output_folder_with_other_files_is_refused(tiny, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="holds files that are not a shardprep artifact"):
        convert(str(tiny.model("llama")), out, Options(tp=1, pp=1), progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_output_folder_with_another_artifact_is_refused(tiny, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(str(tiny.model("llama")), out, Options(tp=1, pp=1), progress=False)
    with pytest.raises(OutputExistsError, match="artifact of another model or topology"):
        convert(str(tiny.model("llama")), out, Options(tp=2, pp=1), progress=False)


def _copy_model(tiny, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny.model("llama"), tmp_path / "model"))


def test_truncated_source_file(tiny, tmp_path: Path) -> None:
    model = _copy_model(tiny, tmp_path)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CorruptFileError, match="is truncated: its header needs"):
        convert(str(model), tmp_path / "out", Options(tp=1, pp=1), progress=False)
    assert not (tmp_path / "out").exists()


def test_header_over_the_size_limit(tiny, tmp_path: Path) -> None:
    model = _copy_model(tiny, tmp_path)
    data = bytearray((model / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 200_000_000)
    (model / "model.safetensors").write_bytes(data)
    with pytest.raises(CorruptFileError, match="header, over the 100,000,000 limit"):
        convert(str(model), tmp_path / "out", Options(tp=1, pp=1), progress=False)


def test_garbled_header(tiny, tmp_path: Path) -> None:
    model = _copy_model(tiny, tmp_path)
    data = bytearray((model / "model.safetensors").read_bytes())
    data[8:12] = b"\xff\xfe{["
    (model / "model.safetensors").write_bytes(data)
    with pytest.raises(CorruptFileError, match="header that is not JSON"):
        convert(str(model), tmp_path / "out", Options(tp=1, pp=1), progress=False)


def test_index_naming_a_missing_file(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", files=2)
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="names model-00002-of-00002.safetensors, missing from"):
        convert(str(model), tmp_path / "out", Options(tp=1, pp=1), progress=False)


def test_not_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        convert(str(tmp_path / "empty"), tmp_path / "out", Options(tp=1, pp=1), progress=False)


def test_tp_that_does_not_divide_leaves_no_output(tiny, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="num_attention_heads \\(4\\) is not divisible by tp=3"):
        convert(str(tiny.model("llama")), tmp_path / "out", Options(tp=3, pp=1), progress=False)
    assert not (tmp_path / "out").exists()


def test_manifest_records_sources_and_rank_parameters(tiny, tmp_path: Path) -> None:
    model = tiny.model("llama")
    draft = tiny.draft("eagle3", model)
    convert(str(model), tmp_path / "out", Options(tp=2, pp=2, draft=str(draft)), progress=False)
    manifest = read_manifest(tmp_path / "out")
    target = manifest.model("target")
    assert target is not None and target.source.files[0].path == "model.safetensors"
    assert target.source.files[0].sha256 is not None
    assert set(target.ranks) == {"pp0-tp0", "pp0-tp1", "pp1-tp0", "pp1-tp1"}
    assert manifest.model("draft").ranks.keys() == {"pp1-tp0", "pp1-tp1"}
    assert (tmp_path / "out/draft/config.json").is_file()
    assert [e.path for e in manifest.extra_files] == [
        "config.json",
        "draft/config.json",
        "generation_config.json",
    ]


def _as_hub_cache(model: Path, root: Path, blob_name=None) -> Path:
    """The model laid out as a Hugging Face cache snapshot: weights are symlinks to
    blobs named by their sha256 (or by `blob_name(path)` when given)."""
    repo = root / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for item in sorted(model.iterdir()):
        if item.suffix != ".safetensors":
            shutil.copyfile(item, snapshot / item.name)
            continue
        name = blob_name(item) if blob_name else hashlib.sha256(item.read_bytes()).hexdigest()
        shutil.copyfile(item, repo / "blobs" / name)
        (snapshot / item.name).symlink_to(f"../../blobs/{name}")
    return snapshot


def test_hub_cache_source_moves_in_the_kernel_to_identical_bytes(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "m", torch_dtype="bfloat16", files=2)
    snapshot = _as_hub_cache(model, tmp_path / "hub")
    options = Options(tp=2, pp=2)
    plain = convert(str(model), tmp_path / "plain", options, progress=False)
    kernel_copies = []
    real_copy = os.copy_file_range
    monkeypatch.setattr(
        os, "copy_file_range", lambda *a: kernel_copies.append(a[2]) or real_copy(*a)
    )
    cached = convert(str(snapshot), tmp_path / "cached", options, progress=False)
    assert kernel_copies, "row-split tensors of a cached source should not pass through memory"
    assert [(f.path, f.sha256) for f in cached.files] == [(f.path, f.sha256) for f in plain.files]
    hashes = [(f.path, f.sha256) for f in cached.model("target").source.files]
    assert hashes == [(f.path, f.sha256) for f in plain.model("target").source.files]
    assert verify(tmp_path / "cached", full=True).ok


def test_hub_blob_name_is_trusted_unless_rehash_source(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")
    snapshot = _as_hub_cache(model, tmp_path / "hub", blob_name=lambda _: "0" * 64)
    manifest = convert(str(snapshot), tmp_path / "a", Options(tp=2, pp=1), progress=False)
    assert manifest.model("target").source.files[0].sha256 == "0" * 64
    with pytest.raises(CorruptFileError, match="not to the sha256 its Hugging Face cache blob"):
        convert(
            str(snapshot), tmp_path / "b", Options(tp=2, pp=1, rehash_source=True), progress=False
        )
    assert not (tmp_path / "b" / MANIFEST_NAME).exists()
