"""gpt-oss (`GptOssForCausalLM`, bfloat16) planned without an engine: gpt-oss-120b's
published config.json (36 layers, 128 experts; `tests/data/gpt-oss-120b/`) and
gpt-oss-20b's (24 layers, 32 experts) at the topologies they are served with, what vLLM's
gpt-oss refuses, and a tiny checkpoint at odd sizes converted and compared, tensor by
tensor, with what vLLM's `load_weights` makes of the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from safetensors.torch import load_file
from schema import SCHEMA

from shardprep.cli import main
from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_model, tiny_config
from shardprep.errors import PlanError
from shardprep.format.manifest import read_manifest
from shardprep.format.request import ConversionRequest
from shardprep.plan import archs
from shardprep.plan.archs.parts import quantized
from shardprep.plan.make import make_plan
from shardprep.plan.records import Plan, SourceModel

DATA = Path(__file__).resolve().parents[2] / "data" / "gpt-oss-120b"
GPT_OSS = "GptOssForCausalLM"
EXPERTS = "mlp.experts.routed_experts."


def published(size: str = "120b", *, bf16: bool = True) -> SourceModel:
    """gpt-oss's published config and the bfloat16 tensors it implies. The published
    checkpoints are MXFP4; `bf16`: the config as a bfloat16 re-upload has it (no
    quantization_config). gpt-oss-20b's config is 120b's with 24 layers and 32 experts."""
    config = json.loads((DATA / "config.json").read_text())
    if size == "20b":
        config |= {"num_hidden_layers": 24, "num_local_experts": 32}
        config["layer_types"] = config["layer_types"][:24]
    if bf16:
        del config["quantization_config"]
        config["torch_dtype"] = "bfloat16"
    shapes = archs.target_family(config)[1].expected_shapes(config)
    return SourceModel(config, {name: ("BF16", shape) for name, shape in shapes.items()})


def shapes_of(plan: Plan, pp: int, tp: int) -> dict[str, tuple[str, tuple]]:
    return {
        t.name: (t.dtype, t.shape)
        for f in plan.files
        if (f.role, f.pp, f.tp) == ("target", pp, tp)
        for t in f.tensors
    }


def test_the_published_config_implies_gpt_oss_120bs_tensors() -> None:
    names = published().tensors
    # Per layer: q/k/v/o weights and biases, 2 norms, sinks, the router's weight and
    # bias, 4 fused expert tensors; embedding, final norm, lm_head.
    assert len(names) == 36 * 17 + 3
    layer = "model.layers.35."
    assert names[f"{layer}mlp.experts.gate_up_proj"] == ("BF16", (128, 2880, 5760))
    assert names[f"{layer}mlp.experts.down_proj"] == ("BF16", (128, 2880, 2880))
    assert names[f"{layer}mlp.experts.down_proj_bias"] == ("BF16", (128, 2880))
    assert names[f"{layer}self_attn.sinks"] == ("BF16", (64,))
    assert names[f"{layer}self_attn.k_proj.weight"] == ("BF16", (512, 2880))
    assert names[f"{layer}mlp.router.weight"] == ("BF16", (128, 2880))
    assert names["lm_head.weight"] == ("BF16", (201088, 2880))


# Each size at one topology in the suite; the others plan with scripts/bench_plan.py.
@pytest.mark.parametrize(("size", "tp", "pp"), [("120b", 8, 2), ("20b", 8, 4)])
def test_gpt_oss_plans_at_the_topologies_it_is_served_with(size: str, tp: int, pp: int) -> None:
    source = published(size)
    layers, experts = (36, 128) if size == "120b" else (24, 32)
    plan = make_plan(source, ConversionRequest(tp=tp, pp=pp))
    assert {(f.pp, f.tp) for f in plan.files} == {(p, t) for p in range(pp) for t in range(tp)}
    (model,) = plan.models
    assert model.family == "gpt_oss" and model.experts is not None
    for stage in range(pp):
        rank = shapes_of(plan, stage, tp - 1)
        first = layers // pp * stage
        prefix = f"model.layers.{first}."
        assert rank[f"{prefix}attn.qkv_proj.weight"] == ("BF16", (512 + 2 * 64, 2880))
        assert rank[f"{prefix}attn.qkv_proj.bias"] == ("BF16", (640,))
        assert rank[f"{prefix}attn.o_proj.weight"] == ("BF16", (2880, 512))
        assert rank[f"{prefix}attn.o_proj.bias"] == ("BF16", (2880,))
        assert rank[f"{prefix}attn.sinks"] == ("BF16", (8,))
        assert rank[f"{prefix}mlp.router.bias"] == ("BF16", (experts,))
        assert rank[f"{prefix}{EXPERTS}w13_weight"] == ("BF16", (experts, 720, 2880))
        assert rank[f"{prefix}{EXPERTS}w2_weight"] == ("BF16", (experts, 2880, 360))
        assert rank[f"{prefix}{EXPERTS}w13_bias"] == ("BF16", (experts, 720))
        assert rank[f"{prefix}{EXPERTS}w2_bias"] == ("BF16", (experts, 2880))
        # vLLM builds the embedding, the final norm and lm_head on every stage.
        assert rank["model.embedding.weight"] == ("BF16", (201088 // tp, 2880))
        assert rank["lm_head.weight"] == ("BF16", (201088 // tp, 2880))
        assert "model.norm.weight" in rank
        held = {int(n.split(".")[2]) for n in rank if n.startswith("model.layers.")}
        assert held == set(range(first, first + layers // pp))


@pytest.mark.parametrize(
    ("pad", "hidden", "rows"), [(None, 2880, 192), ("128,256", 3072, 384), ("32", 2880, 384)]
)
def test_the_published_mxfp4_checkpoint_plans_with_the_backends_padding(
    pad: str | None, hidden: int, rows: int
) -> None:
    config = json.loads((DATA / "config.json").read_text())
    family = archs.target_family(config)[1]
    dtypes = quantized.source_dtypes(family, config)
    shapes = quantized.expected_shapes(family, config)
    source = SourceModel(config, {n: (dtypes.get(n, "BF16"), s) for n, s in shapes.items()})
    plan = make_plan(source, ConversionRequest(tp=8, pp=2, mxfp4_pad=pad))
    rank = shapes_of(plan, 1, 7)
    stack = f"model.layers.18.{EXPERTS}"
    # 90 blocks of 32 over 8 ranks: 12 a rank, 6 on the last one, unpadded (192 rows) or
    # in parameters of 2880 / 8 = 360 rows rounded up to 384 (by 32, 64 or 128)
    assert rank[stack + "w13_weight"] == ("U8", (128, 2 * rows, hidden // 2))
    assert rank[stack + "w13_weight_scale"] == ("U8", (128, 2 * rows, hidden // 32))
    assert rank[stack + "w2_weight"] == ("U8", (128, hidden, rows // 2))
    assert rank[stack + "w2_weight_scale"] == ("U8", (128, hidden, rows // 32))
    assert rank[stack + "w13_bias"] == ("BF16", (128, 2 * rows))
    assert rank[stack + "w2_bias"] == ("BF16", (128, hidden))
    assert rank["model.layers.18.attn.qkv_proj.weight"][0] == "BF16"


def test_tp16_is_refused_because_vllm_splits_the_8_kv_heads_without_replicating() -> None:
    with pytest.raises(PlanError) as info:
        make_plan(published(), ConversionRequest(tp=16, pp=1))
    assert "num_key_value_heads (8) is not divisible by tp=16; vLLM's gpt-oss splits" in str(
        info.value
    )


def test_a_tp_that_gpt_oss_cannot_use_is_refused_with_every_reason() -> None:
    with pytest.raises(PlanError) as info:
        make_plan(published(), ConversionRequest(tp=7, pp=1))
    message = str(info.value)
    assert "num_attention_heads (64) is not divisible by tp=7" in message
    assert "num_key_value_heads (8) is not divisible by tp=7" in message
    assert "intermediate_size (2880) is not divisible by tp x pp x dp = 7" in message


def test_the_world_size_must_divide_the_intermediate_size_and_ep_is_refused() -> None:
    source = published()
    config = {**source.config, "intermediate_size": 2884}  # 2884 = 4 x 721
    shapes = archs.target_family(config)[1].expected_shapes(config)
    odd = SourceModel(config, {name: ("BF16", shape) for name, shape in shapes.items()})
    make_plan(odd, ConversionRequest(tp=4, pp=1))  # world size 4
    with pytest.raises(PlanError, match=r"intermediate_size \(2884\) is not divisible by tp x pp"):
        make_plan(odd, ConversionRequest(tp=4, pp=2))
    with pytest.raises(PlanError, match=r"gpt-oss with expert parallelism is not supported yet"):
        make_plan(source, ConversionRequest(tp=8, pp=1, expert_parallel=True))


# Odd sizes: 6 heads and 3 KV heads at tp3, 3 experts, I = 24 (8 per rank), vocab 960.
ODD = {
    "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
    "intermediate_size": 24, "num_local_experts": 3, "vocab_size": 960, "num_hidden_layers": 2,
}  # fmt: skip


def vllm_rank(source: dict[str, torch.Tensor], layer: int, tp: int, rank: int) -> dict:
    """What vLLM's `_load_weights_other` leaves on tp rank `rank`, from the Hub tensors."""
    p, heads, kv, dim = f"model.layers.{layer}.", 6 // tp, 3 // tp, 16
    s, e = rank * 24 // tp, (rank + 1) * 24 // tp
    hub = f"{p}mlp.experts."
    attn = {x: source[f"{p}self_attn.{x}"] for x in ("q_proj.weight", "k_proj.weight")}
    return {
        f"{p}{EXPERTS}w13_weight": source[f"{hub}gate_up_proj"][:, :, 2 * s : 2 * e].permute(
            0, 2, 1
        ),
        f"{p}{EXPERTS}w2_weight": source[f"{hub}down_proj"][:, s:e, :].permute(0, 2, 1),
        f"{p}{EXPERTS}w13_bias": source[f"{hub}gate_up_proj_bias"][:, 2 * s : 2 * e],
        f"{p}{EXPERTS}w2_bias": source[f"{hub}down_proj_bias"] * (rank == 0),
        f"{p}attn.sinks": source[f"{p}self_attn.sinks"].narrow(0, rank * heads, heads),
        f"{p}attn.o_proj.bias": source[f"{p}self_attn.o_proj.bias"],
        f"{p}mlp.router.weight": source[f"{p}mlp.router.weight"],
        f"{p}attn.qkv_proj.weight": torch.cat(
            [
                attn["q_proj.weight"][rank * heads * dim : (rank + 1) * heads * dim],
                attn["k_proj.weight"][rank * kv * dim : (rank + 1) * kv * dim],
                source[f"{p}self_attn.v_proj.weight"][rank * kv * dim : (rank + 1) * kv * dim],
            ]
        ),
    }


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_odd_sizes_convert_to_what_vllms_load_weights_makes(tmp_path: Path, dtype: str) -> None:
    model = make_tiny_model(tmp_path / "m", GPT_OSS, **ODD)
    source = load_file(model / "model.safetensors")
    out = tmp_path / "out"
    convert(str(model), out, Options(tp=3, pp=1, dtype=dtype), progress=False)
    manifest = read_manifest(out)
    for rank in range(3):
        (entry,) = manifest.rank_files("target", 0, rank)
        ours = load_file(out / entry.path)
        for layer in range(2):
            for name, want in vllm_rank(source, layer, 3, rank).items():
                want = want.to(torch.float32 if dtype == "float32" else torch.bfloat16)
                assert ours[name].shape == want.shape, name
                assert torch.equal(ours[name], want), name
    assert main(["verify", str(out), "--full"]) == 0
    jsonschema.validate(json.loads((out / "shardprep.json").read_text()), SCHEMA)


def test_the_plan_command_lays_out_gpt_oss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "m", GPT_OSS)
    assert main(["plan", str(model), "--tp", "2", "--pp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(m["role"], m["architecture"]) for m in data["models"]] == [("target", GPT_OSS)]


def test_a_checkpoint_saved_by_transformers_5s_gpt_oss_converts(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = tiny_config(GPT_OSS, num_hidden_layers=2)
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gpt_oss", **kwargs), dtype=torch.bfloat16
    )
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["transformers_version"].startswith("5.") and "rope_parameters" in saved
    convert(str(tmp_path / "saved"), tmp_path / "out", Options(tp=2, pp=2), progress=False)
    (entry,) = read_manifest(tmp_path / "out").rank_files("target", 1, 1)
    w13 = load_file(tmp_path / "out" / entry.path)[f"model.layers.1.{EXPERTS}w13_weight"]
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach()  # [E, H, 2I]
    assert torch.equal(w13, gate_up[:, :, 128:].transpose(1, 2))  # gate/up still interleaved
