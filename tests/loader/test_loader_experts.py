"""The loader's expert checks, as users see them (no engine: vLLM's side is given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardprep.errors import TopologyMismatchError
from shardprep.format.manifest import Experts, ModelEntry, ParamSpec, Source
from shardprep.loader.experts import (
    RunningExperts,
    check_device_layout,
    check_expert_parallel,
    check_experts,
)
from shardprep.loader.fill import stack_pads

OUT = Path("out")
HINT = "shardprep convert MODEL --tp 2 --pp 1 EP_FLAGS-o NEW"
EP_ARTIFACT = Experts(
    num_experts=7,
    expert_parallel=True,
    dp=1,
    placement="linear",
    requested_placement="linear",
    rank_experts=((0, 1, 2, 3), (4, 5, 6)),
)
TP_ARTIFACT = Experts(7, False, 1, "linear", "linear", ((0, 1, 2, 3, 4, 5, 6),) * 2)


def running(**changes: object) -> RunningExperts:
    fields: dict[str, object] = {
        "expert_parallel": True,
        "flag": True,
        "dp": 1,
        "placement": "linear",
        "ep_rank": 1,
        "held": (4, 5, 6),
    }
    return RunningExperts(**(fields | changes))  # type: ignore[arg-type]


def target(architecture: str) -> ModelEntry:
    return ModelEntry("target", architecture, "bfloat16", "", 2, Source("m", None, None, ()))


def message(experts: Experts, run: RunningExperts) -> str:
    with pytest.raises(TopologyMismatchError) as info:
        check_experts(OUT, experts, run, HINT)
    return str(info.value)


def test_matching_settings_pass() -> None:
    check_experts(OUT, EP_ARTIFACT, running(), HINT)
    check_experts(OUT, TP_ARTIFACT, running(expert_parallel=False, flag=False, held=None), HINT)


@pytest.mark.parametrize(
    ("architecture", "why"),
    [
        ("KimiK3ForConditionalGeneration", "expert parallelism is not supported for Kimi-K3 yet"),
        ("GptOssForCausalLM", "gpt-oss with expert parallelism is not supported yet"),
        ("DeepseekV4ForCausalLM", "expert parallelism is not supported for DeepSeek-V4 yet"),
    ],
)
def test_a_family_convert_lays_out_without_expert_parallelism_refuses_it(
    architecture: str, why: str
) -> None:
    """An artifact of such a family holds no expert-parallel layout, and at another tp the
    loader would cut one out of it: vLLM run with the flag is refused either way."""
    check_expert_parallel(target(architecture), running(expert_parallel=False, held=None))
    with pytest.raises(TopologyMismatchError) as info:
        check_expert_parallel(target(architecture), running())
    message = str(info.value)
    assert message.startswith(f"vLLM runs {architecture} with --enable-expert-parallel, but {why}")
    assert message.endswith("; start vLLM without --enable-expert-parallel")
    check_expert_parallel(target("DeepseekV3ForCausalLM"), running())  # laid out either way


def test_expert_parallel_off_in_vllm() -> None:
    run = running(expert_parallel=False, flag=False, held=None)
    assert message(EP_ARTIFACT, run) == (
        "artifact out holds experts with expert parallelism on but vLLM runs with it off "
        "(--enable-expert-parallel not given); start vLLM with --enable-expert-parallel, or "
        "re-run `shardprep convert MODEL --tp 2 --pp 1 -o NEW`"
    )


def test_expert_parallel_on_in_vllm() -> None:
    assert message(TP_ARTIFACT, running()) == (
        "artifact out holds experts with expert parallelism off but vLLM runs with it on "
        "(--enable-expert-parallel given); start vLLM without --enable-expert-parallel, or "
        "re-run `shardprep convert MODEL --tp 2 --pp 1 --enable-expert-parallel -o NEW`"
    )


def test_data_parallel_and_placement_and_held_experts() -> None:
    assert "vLLM runs --data-parallel-size 2" in message(EP_ARTIFACT, running(dp=2))
    assert message(EP_ARTIFACT, running(placement="round_robin")) == (
        "artifact out places experts linear but vLLM places them round_robin; start vLLM "
        "with --expert-placement-strategy linear, or re-run `shardprep convert` with "
        "--expert-placement-strategy round_robin"
    )
    assert message(EP_ARTIFACT, running(held=(4, 5, 6, 7))) == (
        "vLLM holds experts [4, 5, 6, 7] on EP rank 1 but artifact out holds [4, 5, 6] there; "
        "start vLLM without --enable-eplb and without redundant experts, as the artifact assumes"
    )


W13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"


def test_padded_expert_stacks_name_the_backend_setting() -> None:
    files = {W13: ParamSpec("BF16", (4, 64, 128)), "norm": ParamSpec("BF16", (128,))}
    check_device_layout(OUT, EP_ARTIFACT, files, {W13: (4, 64, 128), "norm": (128,)})
    with pytest.raises(TopologyMismatchError) as info:
        check_device_layout(OUT, EP_ARTIFACT, files, {W13: (4, 256, 128)})
    assert str(info.value) == (
        f"vLLM built {W13} as [4, 256, 128] but artifact out holds [4, 64, 128]: this MoE "
        "backend pads the experts' intermediate size (FlashInfer TRT-LLM, ROCm AITER; the "
        "artifact assumes moe_intermediate_padding=none); start vLLM with --moe-backend "
        "triton (on ROCm: VLLM_ROCM_USE_AITER_MOE=0)"
    )
    with pytest.raises(TopologyMismatchError, match="VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0"):
        check_device_layout(OUT, EP_ARTIFACT, files, {W13: (5, 64, 128)})


def test_mxfp4_stacks_fit_every_backend_that_pads_as_much_or_more() -> None:
    """A baked --mxfp4-pad 64 (old artifacts) fits a backend that pads more (the loader adds
    the rest); one that pads less is refused, naming the way out: no baked padding."""
    artifact = Experts(
        4, False, 1, "linear", "linear", ((0, 1, 2, 3),) * 2, {"mxfp4_padding": "64"}
    )
    files = {W13: ParamSpec("U8", (4, 128, 64))}
    stacks = stack_pads("gpt_oss_mxfp4")
    check_device_layout(OUT, artifact, files, {W13: (4, 128, 64)}, stacks)
    check_device_layout(OUT, artifact, files, {W13: (4, 256, 128)}, stacks)  # Marlin's
    with pytest.raises(TopologyMismatchError) as info:
        check_device_layout(OUT, artifact, files, {W13: (4, 64, 64)}, stacks)
    assert str(info.value) == (
        f"vLLM built {W13} as [4, 64, 64] but artifact out holds [4, 128, 64]: vLLM's MXFP4 "
        "MoE backend pads the experts less than the artifact, converted with --mxfp4-pad 64; "
        "re-run `shardprep convert` without --mxfp4-pad, which stores the experts unpadded "
        "for every backend"
    )


def test_unpadded_mxfp4_stacks_fit_any_padding_but_not_a_smaller_stack() -> None:
    artifact = Experts(
        4, False, 1, "linear", "linear", ((0, 1, 2, 3),) * 2, {"mxfp4_padding": "at_load"}
    )
    files = {W13: ParamSpec("U8", (4, 96, 48))}
    for built in ((4, 96, 48), (4, 128, 48), (4, 256, 128)):
        check_device_layout(OUT, artifact, files, {W13: built}, stack_pads("mxfp4"))
    with pytest.raises(TopologyMismatchError) as info:
        check_device_layout(OUT, artifact, files, {W13: (4, 80, 48)}, stack_pads("mxfp4"))
    assert str(info.value) == (
        f"vLLM built {W13} as [4, 80, 48] but artifact out holds [4, 96, 48]: the MoE backend "
        "built expert stacks smaller than the rank's MXFP4 blocks, which vLLM's own loader "
        "cannot fill either; start vLLM with another --moe-backend"
    )
