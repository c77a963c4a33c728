"""Kimi-K3 (`KimiK3ForConditionalGeneration`), planned without vLLM: the published
config.json (tests/data/kimi-k3, see SOURCE.md there) with its MXFP4 experts at the
topology it is served with, what is refused and why, the KDA and MLA cuts on real bytes of
a tiny checkpoint, and a config saved by vLLM's own config class under transformers 5."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.quant_configs import KIMI_K3_MXFP4
from shardprep.demo.tiny import make_tiny_model, tiny_config
from shardprep.errors import ConfigError, PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.kimi_k3.text import K3Dims
from shardprep.plan.archs.parts import quantized
from shardprep.plan.make import make_plan
from shardprep.plan.quant import scheme_of
from shardprep.plan.quant.fp4 import Mxfp4PackMoeQuant
from shardprep.plan.quant.layer import Quantized
from shardprep.plan.records import SourceModel

DATA = Path(__file__).resolve().parents[3] / "data" / "kimi-k3"
KIMI = "KimiK3ForConditionalGeneration"
LM = "language_model.model.layers."


def published_config(quantized: bool = False) -> dict:
    config = json.loads((DATA / "config.json").read_text())
    if not quantized:  # the bfloat16 equivalent
        del config["text_config"]["quantization_config"]
    return config


def implied(config: dict) -> SourceModel:
    """The checkpoint the config implies (the family's own table of names and shapes, with
    what the quantization stores in place of each quantized weight)."""
    read = archs.read_config(config)
    family = archs.target_family(read)[1]
    dtypes = quantized.source_dtypes(family, read)
    shapes = quantized.expected_shapes(family, read)
    return SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})


@pytest.fixture(scope="module")
def published() -> SourceModel:
    return implied(published_config())


def test_the_published_config_implies_kimi_k3s_size(published: SourceModel) -> None:
    d = K3Dims.of(archs.read_config(published.config))
    assert (len(d.kda_layers), d.layers - len(d.kda_layers)) == (69, 24)
    assert (d.experts, d.latent) == (896, 3584)
    params = sum(math.prod(shape) for _, shape in published.tensors.values())
    assert round(params / 1e12, 2) == 2.78  # "about 2.8T parameters"
    # 92 MoE layers x 896 experts x 3 projections, and the rest
    assert len(published.tensors) == 249_924


def test_the_published_config_plans_at_tp8_pp2(published: SourceModel) -> None:
    """In bfloat16: as published (MXFP4 experts) it plans in scripts/bench_plan.py
    --model kimi-k3-mxfp4, with twice the expert stacks to lay out (tens of seconds)."""
    plan = make_plan(
        published, ConversionRequest(tp=8, pp=2, stage=1)
    )  # the stage of the last layers
    files = {(f.pp, f.tp) for f in plan.files}
    assert files == {(1, t) for t in range(8)}
    stage1 = {t.name: t for f in plan.files if (f.pp, f.tp) == (1, 3) for t in f.tensors}
    kda = stage1[LM + "89.self_attn.in_proj_qkvgfab.weight"]  # layer 90 (1-based) is KDA
    assert kda.shape == (4 * 1536 + 128 + 12 + 4, 7168)  # 4 zero rows: 6284 aligned to 16
    mla = stage1[LM + "91.self_attn.fused_qkv_a_g_proj.weight"]
    assert mla.shape == (1536 + 576 + 1536, 7168)
    w13 = stage1[LM + "92.block_sparse_moe.experts.routed_experts.w13_weight"]
    assert w13.shape == (896, 2 * 384, 3584)
    assert LM + "0.self_attn.in_proj_qkvgfab.weight" not in stage1
    # 12 vision heads (KimiK3VisionConfig's default) do not split 8 ways: vLLM replicates
    # the tower (`is_vit_use_data_parallel`), on every stage.
    assert stage1["vision_tower.encoder.blocks.26.wqkv.weight"].shape == (3 * 1536, 1152)


def test_what_vllm_would_pad_or_this_project_does_not_place_is_refused_in_one_line() -> None:
    (line,) = K3Dims.of(archs.read_config(published_config())).problems(16)
    assert "each rank holds 192 of the experts' 3072" in line
    assert line.endswith("zero-pads them to that, a layout shardprep does not write yet; "
                         "choose a tp of at most 12")  # fmt: skip
    padded = tiny_config(KIMI)
    del padded["text_config"]["min_moe_intermediate_per_partition"]  # vLLM's 256
    with pytest.raises(PlanError, match="fewer than min_moe_intermediate_per_partition"):
        make_plan(implied(padded), ConversionRequest(tp=2, pp=1))
    tiny = implied(tiny_config(KIMI))
    gdn = tiny_config(KIMI)
    gdn["text_config"]["linear_attn_config"]["use_full_rank_gate"] = False
    with pytest.raises(PlanError, match="full-rank gate only"):
        make_plan(implied(gdn), ConversionRequest(tp=2, pp=1))
    # MXFP4 experts: a rank's intermediate rows (16) not whole groups of 32; sizes that
    # vLLM's MXFP4 MoE backends pad (64 rows a rank at tp4) plan, stored unpadded.
    split = implied(tiny_config(KIMI, quantization_config=copy.deepcopy(KIMI_K3_MXFP4)))
    with pytest.raises(PlanError) as caught:
        make_plan(split, ConversionRequest(tp=2, pp=1))
    assert (
        "vLLM refuses mxfp4 groups of 32 at tp=2: language_model.model.layers.*.block_sparse_moe"
        ".experts: MXFP4 MoE stores the intermediate size per rank (16) in groups of 32, which "
        "it does not divide. Choose a tp that works: 1"
    ) in str(caught.value)
    sizes = {"moe_intermediate_size": 256, "routed_expert_hidden_size": 256}
    padded = implied(tiny_config(KIMI, quantization_config=copy.deepcopy(KIMI_K3_MXFP4), **sizes))
    assert make_plan(padded, ConversionRequest(tp=4, pp=1)).models[0].experts is not None
    with pytest.raises((ConfigError, PlanError), match="draft of method 'eagle3' for Kimi-K3"):
        make_plan(tiny, ConversionRequest(tp=2, pp=1, draft_method="eagle3"), tiny)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8, 12, 16])
def test_the_published_experts_are_refused_only_where_kimi_k3_pads_them(tp: int) -> None:
    """The published experts (3072 intermediate rows over a latent width of 3584) as vLLM's
    MXFP4 method sees them: whole groups of 32 at every tp here, and a backend's padding
    is made at load; at tp16 Kimi-K3's own padding to 256 rows a rank is refused."""
    read = archs.read_config(published_config(quantized=True))
    family = archs.target_family(read)[1]
    scheme = family.quant_scheme(scheme_of(read))
    assert isinstance(scheme, Mxfp4PackMoeQuant) and scheme.method == "mxfp4"
    layer = Quantized(LM + "*.block_sparse_moe.experts", "experts", 3584, ((3072, 0),))
    assert scheme.refusals(layer, tp, tp) == []
    padded = [p for p in family.check(read, tp) if "min_moe_intermediate_per_partition" in p]
    assert bool(padded) == (tp == 16)


def test_mxfp4_experts_are_the_source_bytes(tmp_path: Path) -> None:
    """vLLM's `w13_weight` of a rank: the rank's gate rows, then its up rows, of each
    expert's `weight_packed` (K, the latent width, two values a byte, whole); `w2_weight`:
    the rank's half of the packed columns; the e8m0 scales cut alike, in groups of 32."""
    model = make_tiny_model(
        tmp_path / "model", KIMI, quantization_config=copy.deepcopy(KIMI_K3_MXFP4),
        moe_intermediate_size=256, routed_expert_hidden_size=256, num_hidden_layers=2,
        torch_dtype="bfloat16",
    )  # fmt: skip
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=2, pp=1), progress=False)
    assert read_manifest(out).models[0].quantization == "mxfp4"
    source = load_file(model / "model.safetensors")
    ours: dict[str, torch.Tensor] = {}
    for entry in read_manifest(out).rank_files("target", 0, 1):
        ours.update(load_file(out / entry.path))
    experts = LM + "1.block_sparse_moe.experts."
    for suffix, param in (("weight_packed", "weight"), ("weight_scale", "weight_scale")):
        w13 = [
            torch.cat([source[f"{experts}{e}.{w}.{suffix}"][128:] for w in ("w1", "w3")])
            for e in range(8)
        ]
        assert torch.equal(ours[f"{experts}routed_experts.w13_{param}"], torch.stack(w13))
        w2 = [source[f"{experts}{e}.w2.{suffix}"].chunk(2, dim=1)[1] for e in range(8)]
        assert torch.equal(ours[f"{experts}routed_experts.w2_{param}"], torch.stack(w2))
    down = LM + "1.block_sparse_moe.routed_expert_down_proj.weight"
    assert torch.equal(ours[down], source[down])  # unquantized, whole
    report = verify(out, full=True, progress=False)
    assert not report.problems and report.round_trip_tensors > 0


def test_kda_and_mla_cuts_on_real_bytes(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", KIMI)
    source = load_file(model / "model.safetensors")
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=2, pp=1, dtype="float32"), progress=False)
    layer = LM + "0.self_attn."
    mla = LM + "1.self_attn."
    for tp in range(2):
        ours: dict[str, torch.Tensor] = {}
        for entry in read_manifest(artifact).rank_files("target", 0, tp):
            ours.update(load_file(artifact / entry.path))
        rows = slice(32 * tp, 32 * tp + 32)
        parts = [source[layer + f"{x}_proj.weight"][rows] for x in "qkvg"]
        parts += [source[layer + "f_a_proj.weight"], source[layer + "b_proj.weight"][2 * tp :][:2]]
        expected = torch.cat([*parts, torch.zeros(14, 64)])
        assert torch.equal(ours[layer + "in_proj_qkvgfab.weight"], expected)
        conv = torch.cat([source[layer + f"{x}_conv1d.weight"][rows] for x in "qkv"])
        assert torch.equal(ours[layer + "conv1d.weight"], conv)
        assert ours[layer + "A_log"].dtype == torch.float32
        assert torch.equal(ours[layer + "A_log"], source[layer + "A_log"][2 * tp :][:2])
        gate = source[mla + "g_proj.weight"][rows]
        fused = [source[mla + "q_a_proj.weight"], source[mla + "kv_a_proj_with_mqa.weight"], gate]
        assert torch.equal(ours[mla + "fused_qkv_a_g_proj.weight"], torch.cat(fused))


def test_a_config_saved_by_vllms_class_under_transformers_5_converts_the_same(
    tmp_path: Path,
) -> None:
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    model = make_tiny_model(tmp_path / "model", KIMI)
    saved = tmp_path / "saved"
    saved.mkdir()
    for path in model.iterdir():
        (saved / path.name).write_bytes(path.read_bytes())
    config = json.loads((model / "config.json").read_text())
    KimiK3Config(**{k: v for k, v in config.items() if k != "model_type"}).save_pretrained(saved)
    written = json.loads((saved / "config.json").read_text())
    assert written["transformers_version"].startswith("5.") and "torch_dtype" not in written
    options = Options(tp=2, pp=2)
    convert(str(model), tmp_path / "a", options, progress=False)
    convert(str(saved), tmp_path / "b", options, progress=False)
    for a, b in zip(
        read_manifest(tmp_path / "a").files, read_manifest(tmp_path / "b").files, strict=True
    ):
        assert a.path == b.path
        assert (tmp_path / "a" / a.path).read_bytes() == (tmp_path / "b" / b.path).read_bytes()


def test_after_fill_redoes_the_kda_decode_copies_vllms_weight_loaders_make() -> None:
    """vLLM's own weight loaders (`kda.py`, which a GPU's fused decode kernel selects) fill
    `decode_conv1d_weight` and `decode_norm_weight` as they load; after `sharded-fast`
    copied the rank's parameters, the family's hook leaves the same bytes."""
    from vllm.models.kimi_k3.nvidia import kda

    projection, kernel, tp, rank, head_dim = 48, 4, 2, 1, 16
    local = projection // tp

    def layer() -> torch.nn.Module:
        module = torch.nn.Module()
        module.conv1d = torch.nn.Module()
        module.conv1d.weight = torch.nn.Parameter(torch.zeros(3 * local, 1, kernel))
        module.o_norm = torch.nn.Module()
        module.o_norm.weight = torch.nn.Parameter(torch.zeros(head_dim, dtype=torch.bfloat16))
        module.register_buffer("decode_conv1d_weight", torch.zeros(3, kernel, local))
        module.register_buffer("decode_norm_weight", torch.zeros(head_dim))
        return module

    generator = torch.Generator().manual_seed(3)
    parts = [torch.randn(projection, 1, kernel, generator=generator) for _ in range(3)]
    norm = torch.randn(head_dim, generator=generator).to(torch.bfloat16)
    vllm = layer()
    conv_loader = kda._make_decode_conv1d_weight_loader(
        [projection] * 3, tp, rank, vllm.decode_conv1d_weight
    )
    for shard, part in enumerate(parts):
        conv_loader(vllm.conv1d.weight, part, shard)
    kda._make_decode_norm_weight_loader(vllm.decode_norm_weight)(vllm.o_norm.weight, norm)
    ours = layer()
    with torch.no_grad():
        ours.conv1d.weight.copy_(vllm.conv1d.weight)  # what sharded-fast copies in
        ours.o_norm.weight.copy_(vllm.o_norm.weight)
    archs.target_family_of(KIMI).after_fill(ours, {"conv1d.weight", "o_norm.weight"})
    assert vllm.decode_conv1d_weight.any()
    assert torch.equal(ours.decode_conv1d_weight, vllm.decode_conv1d_weight)
    assert torch.equal(ours.decode_norm_weight, vllm.decode_norm_weight)


@pytest.mark.parametrize("architecture", [KIMI, "KimiK25ForConditionalGeneration"])
def test_a_tower_replicated_at_tp8_converts_to_an_artifact_its_reader_takes(
    tmp_path: Path, architecture: str
) -> None:
    """tp8 splits the text model's 8 heads but not the tower's 4: the tower's fused qkv is
    replicated, and its piece names no heads (the reader refuses heads on a replicated
    piece); verify and the reader take the artifact."""
    from shardprep.format.manifest import read_regions

    text = {"num_attention_heads": 8, "num_key_value_heads": 8}
    if architecture == KIMI:
        linear = dict(tiny_config(KIMI)["text_config"]["linear_attn_config"], num_heads=8)
        text |= {"moe_intermediate_size": 128, "linear_attn_config": linear}
    else:
        text |= {"moe_intermediate_size": 64, "intermediate_size": 128}
    source = make_tiny_model(tmp_path / "src", architecture, **text)
    convert(str(source), tmp_path / "out", Options(tp=8, pp=2), progress=False)
    manifest = read_regions(tmp_path / "out", read_manifest(tmp_path / "out"))
    (wqkv,) = manifest.models[0].pieces["vision_tower.encoder.blocks.0.wqkv.weight"]
    assert (wqkv.cut, wqkv.heads) == ("replicate", 0)
    assert verify(tmp_path / "out").ok
