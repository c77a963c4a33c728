"""MXFP4 experts as gpt-oss publishes them (`quantization_config.quant_method: mxfp4`).

Each fused expert weight is stored as e2m1 values two to a byte, `x_blocks` uint8
[E, N, K/32, 16], with one e8m0 exponent per 32 values, `x_scales` uint8 [E, N, K/32]
(gate_up_proj: N = 2I gate/up rows interleaved, K = H; down_proj: N = H, K = I). vLLM's
`GptOssMxfp4MoEMethod` and `_load_weights_mxfp4` view the blocks as [E, N, K/2] and give
every rank whole 32-blocks of the intermediate size, ceil(I/32 / tp) of them (the last
rank what is left): `w13_weight` rows [2s, 2e), `w2_weight` columns [s/2, e/2), the
scales cut the same way, `w13_bias` values [2s, 2e), `w2_bias` whole on rank 0 and zero
on the others (bfloat16, whatever the model's dtype).

The parameters are sized by the MoE backend, which rounds the per-rank intermediate
size (I/tp) and the hidden size up to its own alignment, and the loader copies each
part into their top-left corner: the state before processing depends on the backend
that serves it. The rank files hold each rank's blocks unpadded, and `sharded-fast` pads
them in memory to whatever the running backend built (backend_pad.py), so one artifact
serves every backend, and every tp dividing its own where the ranks' blocks nest
(`Manifest.served_tps`). `--mxfp4-pad` still bakes one
backend's padding in (`Mxfp4Pad`), for an artifact that serves that padding at its own tp
only; the manifest records which (the experts' `mxfp4_padding`: `at_load` or the padding).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.errors import ConfigError
from shardprep.format.cut_names import MXFP4_PADDING_AT_LOAD
from shardprep.plan.cuts import MX_BLOCK, Cut, Piece, ScaleOf
from shardprep.plan.quant.base import MXFP4, Example, Scheme
from shardprep.plan.quant.layer import Quantized, QuantParams

Config = Mapping[str, Any]
BYTE = "U8"
BIAS_DTYPE = "BF16"  # vLLM's MXFP4 expert biases, whatever the model's dtype
PER_BYTE = 2  # e2m1 values to a byte
# The backends' alignments of (per-rank intermediate, hidden), as vLLM's
# `mxfp4_round_up_hidden_size_and_intermediate_size` rounds them.
BACKENDS = (
    ("32", "CPU and emulation"),
    ("64", "the default of CUDA GPUs: OpenAI Triton kernels"),
    ("128,128", "CUTLASS, DeepGEMM, FlashInfer CUTLASS"),
    ("128,256", "Marlin, FlashInfer TRT-LLM"),
    ("256,256", "ROCm AITER"),
)
# (Hub tensor under mlp.experts., its cut in vLLM) of the fused expert weights.
W13, W2 = "gate_up_proj", "down_proj"


@dataclass(frozen=True)
class Mxfp4Pad:
    """The MoE backend's alignment of the per-rank intermediate size and of the hidden
    size (1: none)."""

    intermediate: int = 64
    hidden: int = 1

    @classmethod
    def parse(cls, text: str | None) -> Mxfp4Pad | None:
        """`"64"` or `"128,256"` (intermediate, hidden); None: none baked in."""
        if text is None:
            return None
        try:
            sizes = [int(part) for part in text.split(",")]
        except ValueError:
            sizes = []
        good = 1 <= len(sizes) <= 2 and sizes[0] % MX_BLOCK == 0 and all(s > 0 for s in sizes)
        if not good:
            raise ConfigError(
                f"--mxfp4-pad {text!r} is not an alignment vLLM's MXFP4 MoE uses; give the "
                "per-rank intermediate alignment (a multiple of 32), optionally with the "
                f"hidden one: {choices()}"
            )
        return cls(sizes[0], sizes[1] if len(sizes) == 2 else 1)

    @property
    def text(self) -> str:
        return str(self.intermediate) + (f",{self.hidden}" if self.hidden > 1 else "")


def choices() -> str:
    return "; ".join(f"{pad} ({who})" for pad, who in BACKENDS)


@dataclass(frozen=True)
class Mxfp4Quant(Scheme):
    name: ClassVar[str] = "mxfp4"  # the scheme, which keys its layout revision
    # vLLM's quantization method (`GptOssMxfp4Config`, from the checkpoint's "mxfp4")
    method: ClassVar[str] = "gpt_oss_mxfp4"
    param_suffixes: ClassVar[tuple[str, ...]] = ("_scale",)  # `w13_weight_scale`

    pad: Mxfp4Pad | None = None  # a backend's padding baked in (--mxfp4-pad); None: unpadded
    problem: str = ""
    ignored: tuple[str, ...] = ()

    @property
    def describe(self) -> str:
        if self.pad is None:
            return "mxfp4 experts, padded at load for the running backend"
        return f"mxfp4 experts padded to {self.pad.text}"

    def for_request(self, mxfp4_pad: str | None) -> Mxfp4Quant:
        """With the backend's padding `--mxfp4-pad` baked in (None: unpadded)."""
        return dataclasses.replace(self, pad=Mxfp4Pad.parse(mxfp4_pad))

    @property
    def padding(self) -> str:
        """What the manifest records of the stacks' padding (`mxfp4_padding`)."""
        return MXFP4_PADDING_AT_LOAD if self.pad is None else self.pad.text

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """A fused expert weight [E, K, N] (the Hub's bf16 layout) as its blocks
        [E, N, K/32, 16] and scales [E, N, K/32]."""
        experts, k, n = shape
        return {
            weight + "_blocks": ((experts, n, k // MX_BLOCK, MX_BLOCK // PER_BYTE), BYTE),
            weight + "_scales": ((experts, n, k // MX_BLOCK), BYTE),
        }

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        """A random weight [E, N, K] encoded in MXFP4 (the whole blocks of K)."""
        experts, k, n = shape
        encoded = Example(MXFP4, (experts, n, k // MX_BLOCK * MX_BLOCK), (weight + "_scales",))
        return {weight + "_blocks": encoded}

    def logical(self, source: str) -> str:
        return source.removesuffix("_blocks").removesuffix("_scales")

    def skips(self, layer: str, *parts: str) -> bool:
        return False  # vLLM quantizes every expert layer and nothing else

    def places(self, kind: str) -> bool:
        return kind == "experts"

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """`w13_weight`/`w2_weight` and their `_scale`, uint8, from the blocks and scales."""
        cut = Cut.MX_W13 if pieces[0].cut is Cut.EXPERT_COLS_T else Cut.MX_W2

        def stack(suffix: str, per: int) -> tuple[Piece, ...]:
            out = []
            for p in pieces:
                _, k, n = shapes[p.source]
                logical = (n, k)  # w13: [2I, H]; w2: [H, I]
                of = ScaleOf(logical, Cut.ROWS, (1, per), self.grid)
                out.append(Piece(p.source + suffix, cut, expert=p.expert, scale_of=of))
            return tuple(out)

        return [
            (name, stack("_blocks", PER_BYTE), BYTE),
            (name + "_scale", stack("_scales", MX_BLOCK), BYTE),
        ], {}

    @property
    def grid(self) -> tuple[int, int] | None:
        """The baked alignments of (per-rank intermediate, hidden); None: unpadded."""
        return None if self.pad is None else (self.pad.intermediate, self.pad.hidden)

    def alongside(
        self, pieces: tuple[Piece, ...], shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[tuple[Piece, ...], str | None] | None:
        """The expert biases of an MXFP4 layer, cut and padded as its weights are."""
        cuts = {Cut.EXPERT_ROW: Cut.MX_W13_BIAS, Cut.EXPERT_ROW_FIRST: Cut.MX_W2_BIAS}
        if not pieces or pieces[0].cut not in cuts:
            return None
        out = []
        for p in pieces:
            size = shapes[p.source][1]
            of = ScaleOf((1, size), Cut.ROWS, (1, 1), self.grid)
            out.append(Piece(p.source, cuts[p.cut], expert=p.expert, scale_of=of))
        return tuple(out), BIAS_DTYPE

    def derived_cuts(self, source: str, shape: tuple[int, ...], expert: int | None) -> list[Piece]:
        """An expert's blocks or scales [E, N, K/32, ...] as either fused expert weight
        cuts them, and an expert's bias [E, B] as either bias is cut: vLLM's record tells
        which (and the unpadded ones alone give its regions where no padding is baked)."""
        if expert is None or len(shape) < 2:
            return []
        if len(shape) == 2:
            of = ScaleOf((1, shape[1]), Cut.ROWS, (1, 1), self.grid)
            cuts = (Cut.MX_W13_BIAS, Cut.MX_W2_BIAS)
        elif source.endswith(("_blocks", "_scales")):
            per = PER_BYTE if source.endswith("_blocks") else MX_BLOCK
            of = ScaleOf((shape[1], math.prod(shape[2:]) * per), Cut.ROWS, (1, per), self.grid)
            cuts = (Cut.MX_W13, Cut.MX_W2)
        else:
            return []
        return [Piece(source, cut, expert=expert, scale_of=of) for cut in cuts]

    def derived_dtype(self, cut: Cut) -> str | None:
        """The blocks and scales are bytes, the biases bfloat16, whatever the model's dtype."""
        biases = (Cut.MX_W13_BIAS, Cut.MX_W2_BIAS)
        return BIAS_DTYPE if cut in biases else BYTE if cut in (Cut.MX_W13, Cut.MX_W2) else None

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """What vLLM cannot load: values not in whole 32-blocks."""
        if layer.kind != "experts":
            return []
        problems = []
        for what, size in (
            ("hidden_size", layer.input),
            ("intermediate_size", layer.outputs[0][0]),
        ):
            if size % MX_BLOCK:
                problems.append(
                    f"{layer.name}: MXFP4 stores {what} ({size}) in blocks of {MX_BLOCK}, "
                    "which it does not divide."
                )
        return problems


def mxfp4_quant(quant: Config) -> Mxfp4Quant:
    """The MXFP4 scheme of gpt-oss's `quantization_config`, unpadded (a baked padding comes
    later, from the conversion request: `for_request`)."""
    ignored = quant.get("modules_to_not_convert") or []
    return Mxfp4Quant(ignored=tuple(ignored) if isinstance(ignored, list) else ())
