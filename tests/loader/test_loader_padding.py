"""Parameters vLLM pads at load on some devices: DeepSeek-V4's `attn_sink` on NVIDIA GPUs.

vLLM's DeepSeek-V4 attention (`models/deepseek_v4/attention.py`) builds
`attn_sink = torch.full((padded_heads,), -inf, float32)`, `padded_heads` being
`get_padded_num_q_heads(n_local_heads)` of the attention class: the heads themselves on
the CPU, ROCm and XPU builds; 64 or 128 with FlashMLA (`nvidia/flashmla.py`, more than 128
refused); the next of 8, 16, 32, 64, 128 with FlashInfer (`nvidia/flashinfer_sparse.py`).
Its `load_weights` then copies the rank's heads into `attn_sink[:n]` and leaves the rest
at -inf. The rank files hold the rank's heads only, so `sharded-fast` must fill the front
of such a parameter and leave the rest as vLLM initialized it, and nothing else may be
shorter than its parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardprep.errors import WeightMismatchError
from shardprep.loader.fill import fill_parameters, fits_padded
from shardprep.plan import archs

SINK = "model.layers.0.attn.attn_sink"


def flashmla_heads(heads: int) -> int:
    """FlashMLA's `get_padded_num_q_heads`, as vLLM 0.32 writes it."""
    return 64 if heads <= 64 else 128


class Attention(nn.Module):
    """The parameters of one padded DeepSeek-V4 attention layer, as vLLM builds them."""

    def __init__(self, heads: int, padded: int) -> None:
        super().__init__()
        self.attn_sink = nn.Parameter(
            torch.full((padded,), -float("inf"), dtype=torch.float32), requires_grad=False
        )
        self.wq_b = nn.Parameter(torch.zeros(heads * 2, 3), requires_grad=False)


class Model(nn.Module):
    def __init__(self, heads: int, padded: int) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].attn = Attention(heads, padded)


def fill(model: nn.Module, tensors: dict[str, torch.Tensor], family: str = "deepseek_v4") -> list:
    padded = archs.target_family_of("DeepseekV4ForCausalLM").padded_at_load
    if family == "llama":
        padded = archs.target_family_of("LlamaForCausalLM").padded_at_load
    return fill_parameters(
        model, tensors.items(), ignorable=set(), may_lack=set(), where="OUT", padded=padded
    )


@pytest.mark.parametrize("heads", [1, 3, 8, 64, 128])
def test_a_padded_sink_gets_the_ranks_heads_first_and_minus_infinity_after(heads: int) -> None:
    padded = flashmla_heads(heads)
    model = Model(heads, padded)
    sink = torch.randn(heads, dtype=torch.float32)
    wq_b = torch.randn(heads * 2, 3)
    filled = fill(model, {SINK: sink, "model.layers.0.attn.wq_b": wq_b})
    assert sorted(filled) == [SINK, "model.layers.0.attn.wq_b"]
    built = model.model.layers[0].attn.attn_sink
    assert built.shape == (padded,)
    # byte for byte: the rank's heads, then vLLM's -inf padding
    expected = torch.cat([sink, torch.full((padded - heads,), -float("inf"))])
    assert built.view(torch.int32).tolist() == expected.view(torch.int32).tolist()


def test_a_sink_of_the_exact_size_is_copied_whole() -> None:
    model = Model(4, 4)  # the CPU build: no padding
    sink = torch.arange(4, dtype=torch.float32)
    fill(model, {SINK: sink, "model.layers.0.attn.wq_b": torch.ones(8, 3)})
    assert torch.equal(model.model.layers[0].attn.attn_sink, sink)


def test_only_the_family_s_padded_parameters_may_be_shorter() -> None:
    """A shorter tensor of any other parameter, a sink longer than the parameter, a sink of
    another dtype, or a family without padding: refused as before, in one message."""
    model = Model(4, 64)
    with pytest.raises(WeightMismatchError) as info:
        fill(model, {SINK: torch.zeros(4), "model.layers.0.attn.wq_b": torch.ones(4, 3)})
    assert "1 shape mismatch(es) (model.layers.0.attn.wq_b: file (4, 3), model (8, 3))" in str(
        info.value
    )
    with pytest.raises(WeightMismatchError, match=r"attn_sink: file \(65,\), model \(64,\)"):
        fill(Model(4, 64), {SINK: torch.zeros(65), "model.layers.0.attn.wq_b": torch.ones(8, 3)})
    with pytest.raises(WeightMismatchError, match="attn_sink: file torch.float64"):
        fill(
            Model(4, 64),
            {
                SINK: torch.zeros(4, dtype=torch.float64),
                "model.layers.0.attn.wq_b": torch.ones(8, 3),
            },
        )
    with pytest.raises(WeightMismatchError, match=r"attn_sink: file \(4,\), model \(64,\)"):
        fill(
            Model(4, 64),
            {SINK: torch.zeros(4), "model.layers.0.attn.wq_b": torch.ones(8, 3)},
            family="llama",
        )


def test_the_v4_families_name_the_sinks_and_nothing_else() -> None:
    target = archs.target_family_of("DeepseekV4ForCausalLM")
    draft = archs.draft_family("dspark", "deepseek_v4")
    for family in (target, draft):
        assert family.padded_at_load("model.layers.12.attn.attn_sink")
        assert not family.padded_at_load("model.layers.12.attn.wq_b.weight")
        assert not family.padded_at_load("model.layers.12.attn.indexer.attn_sink.x")
    assert not archs.draft_family("dspark", "llama").padded_at_load(SINK)


@pytest.mark.parametrize(
    ("stored", "built", "fits"),
    [
        ((3,), (64,), True),
        ((64,), (64,), True),
        ((65,), (64,), False),
        ((3, 2), (8, 2), True),
        ((3, 2), (8, 3), False),
        ((3,), (8, 1), False),
        ((), (), False),
    ],
)
def test_fits_padded_on_odd_shapes(stored: tuple, built: tuple, fits: bool) -> None:
    assert fits_padded(stored, built) is fits


@pytest.mark.vllm  # imports vLLM's NVIDIA attention classes (importable on the CPU build)
def test_the_padding_rule_here_is_vllm_s() -> None:
    """The head counts these tests pad to are FlashMLA's own, and the padded counts of
    both NVIDIA backends leave the rank's heads a front to fill."""
    pytest.importorskip("vllm")
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLAAttention,
    )
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    for heads in range(1, 129):
        flashmla = DeepseekV4FlashMLAAttention.get_padded_num_q_heads(heads)
        flashinfer = DeepseekV4FlashInferMLAAttention.get_padded_num_q_heads(heads)
        assert flashmla == flashmla_heads(heads)
        assert fits_padded((heads,), (flashmla,)) and fits_padded((heads,), (flashinfer,))
    with pytest.raises(ValueError, match="does not support 129 heads"):
        DeepseekV4FlashMLAAttention.get_padded_num_q_heads(129)
