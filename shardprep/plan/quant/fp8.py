"""fp8 block quantization (`quantization_config.quant_method: fp8` with
`weight_block_size`), as vLLM's `Fp8LinearMethod` builds and checks it: weights stay fp8,
each has a float32 `weight_scale_inv` of one scale per block."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from shardprep.plan.cuts import Cut, Piece, ScaleOf, matrix
from shardprep.plan.quant.base import FP8_VALUES, SCALE, Example, Scheme
from shardprep.plan.quant.fp8_tensor import TensorQuant, tensor_quant
from shardprep.plan.quant.ignore import not_converted
from shardprep.plan.quant.layer import Quantized, QuantParams
from shardprep.plan.topology import kv_heads_of_rank

Config = Mapping[str, Any]
FP8 = "F8_E4M3"  # the weights' safetensors dtype
SCALE_DTYPE = "F32"


@dataclass(frozen=True)
class BlockQuant(Scheme):
    name: ClassVar[str] = "fp8_block"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "fp8"  # vLLM's quantization method
    # `x.weight_scale_inv`; with the KV-cache scales a checkpoint ships, `attn.k_scale`...
    param_suffixes: ClassVar[tuple[str, ...]] = ("_scale_inv", "_scale")
    kv_cache_scales: ClassVar[bool] = True

    block: tuple[int, int]  # (block_n: output rows, block_k: input columns)
    problem: str = ""  # why vLLM cannot load this quantization, if it cannot
    # Layers vLLM leaves unquantized (`ignored_layers`, else `modules_to_not_convert`),
    # matched exactly against the layer's name as vLLM's `Fp8Config` does.
    ignored: frozenset[str] = frozenset()

    def scale_shape(self, weight: tuple[int, ...]) -> tuple[int, int]:
        return -(-weight[0] // self.block[0]), -(-weight[1] // self.block[1])

    def stored(self, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple, str]]:
        """The checkpoint tensors of one quantized weight: {name: (shape, dtype)}."""
        return {weight: (shape, FP8), scale_name(weight): (self.scale_shape(shape), SCALE_DTYPE)}

    def examples(self, weight: str, shape: tuple[int, ...]) -> dict[str, Example]:
        return {weight: Example(FP8_VALUES), scale_name(weight): Example(SCALE)}

    def skips(self, *layers: str) -> bool:
        """Whether vLLM leaves a layer unquantized; `layers`: its names (vLLM's fused
        name, then the checkpoint's names of its parts)."""
        return not_converted(self.ignored, *layers)

    @property
    def describe(self) -> str:
        return f"fp8 blocks {list(self.block)}"

    def params(
        self,
        name: str,
        pieces: tuple[Piece, ...],
        shapes: Mapping[str, tuple[int, ...]],
        tp: int,
        moe_ways: int,
    ) -> QuantParams:
        """The fp8 weight parameter `name` and its block scales, as (name, pieces, dtype)."""
        scales = tuple(_scale_piece(p, shapes, self, moe_ways) for p in pieces)
        return [(name, pieces, FP8), (scale_name(name), scales, SCALE_DTYPE)], {}

    def refusals(self, layer: Quantized, tp: int, moe_ways: int) -> list[str]:
        """vLLM's block checks of one layer at `tp`, in its words."""
        if layer.kind == "experts":
            inter, hidden = layer.outputs[0][0], layer.input
            problems = moe_block_problems(self, inter // moe_ways, hidden, moe_ways)
            return [f"{layer.name}: {p}" for p in problems]
        total = sum(rows for rows, _ in layer.outputs)
        if layer.kind == "row":
            shape = LinearShape.row(layer.name, layer.input, total, tp)
        elif layer.kind == "replicated":
            parts = tuple(r for r, _ in layer.outputs)
            shape = LinearShape.replicated(layer.name, layer.input, parts)
        else:
            sizes = tuple(_rows_per_rank(rows, heads, tp) for rows, heads in layer.outputs)
            shape = LinearShape(layer.name, layer.input, total, tp, sizes)
        return block_problems([shape], self)


def scale_name(weight: str) -> str:
    """`x.weight` -> `x.weight_scale_inv` (vLLM's fused stacks too: `w13_weight_scale_inv`)."""
    return weight + "_scale_inv"


def block_quant(config: Config) -> BlockQuant | TensorQuant | None:
    """The fp8 quantization config.json declares (blocks, or per tensor without
    `weight_block_size`), or None for an unquantized model."""
    quant = config.get("quantization_config")
    return fp8_quant(quant) if quant else None


def fp8_quant(quant: Config) -> BlockQuant | TensorQuant:
    """The scheme of an fp8 `quantization_config`; one it cannot lay out (or of another
    `quant_method`) comes back with its `problem` set."""
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method != "fp8":
        return BlockQuant(
            (1, 1),
            f"quantization_config has quant_method {method!r}; shardprep supports fp8 "
            "(blocks or per tensor) and compressed-tensors",
        )
    ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or []
    if not isinstance(ignored, list) or not all(isinstance(n, str) for n in ignored):
        return BlockQuant((1, 1), "quantization_config's modules_to_not_convert is not a list")
    if not block:
        return tensor_quant(quant, frozenset(ignored))
    size = block_size(block)
    if size is None:
        return BlockQuant(
            (1, 1),
            f"quantization_config has weight_block_size {block!r}, which is not two whole "
            "numbers of at least 1 as vLLM needs; fix config.json",
        )
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        return BlockQuant((1, 1), "fp8 blocks need activation_scheme dynamic")
    return BlockQuant(size, ignored=frozenset(ignored))


def block_size(block: object) -> tuple[int, int] | None:
    """A 2-D block size as vLLM divides by it: two JSON integers of at least 1 (not a
    float, a string or a bool), else None."""
    if not isinstance(block, list) or len(block) != 2:
        return None
    if not all(type(b) is int and b >= 1 for b in block):
        return None
    return block[0], block[1]


@dataclass(frozen=True)
class LinearShape:
    """A linear layer as vLLM builds it on one rank (the arguments of
    `validate_fp8_block_shape`)."""

    name: str
    input_size: int
    output_size: int
    tp: int  # the layer's own tp size (1 when vLLM replicates it)
    output_partition_sizes: tuple[int, ...]
    input_per_partition: int = 0  # 0: the whole input

    @classmethod
    def column(cls, name: str, input_size: int, output_size: int, tp: int) -> LinearShape:
        return cls(name, input_size, output_size, tp, (output_size // tp,))

    @classmethod
    def replicated(cls, name: str, input_size: int, outputs: tuple[int, ...]) -> LinearShape:
        return cls(name, input_size, sum(outputs), 1, outputs)

    @classmethod
    def merged(cls, name: str, input_size: int, outputs: tuple[int, ...], tp: int) -> LinearShape:
        return cls(name, input_size, sum(outputs), tp, tuple(o // tp for o in outputs))

    @classmethod
    def row(cls, name: str, input_size: int, output_size: int, tp: int) -> LinearShape:
        return cls(name, input_size, output_size, tp, (output_size,), input_size // tp)


def block_problems(layers: list[LinearShape], quant: BlockQuant) -> list[str]:
    """vLLM's `validate_fp8_block_shape` for each layer, with its own words."""
    block_n, block_k = quant.block
    problems = []
    for layer in layers:
        per_input = layer.input_per_partition or layer.input_size
        if layer.tp > 1 and layer.input_size // per_input == layer.tp and per_input % block_k:
            problems.append(
                f"{layer.name}: Weight input_size_per_partition = {per_input} is not "
                f"divisible by weight quantization block_k = {block_k}."
            )
            continue
        sizes = layer.output_partition_sizes
        is_tp_split = layer.tp > 1 and layer.output_size // sum(sizes) == layer.tp
        if not is_tp_split and len(sizes) > 1:
            sizes = sizes[:-1]  # a merged layer's last matrix may end in a partial block
        elif not is_tp_split:
            sizes = ()
        for size in sizes:
            if size % block_n:
                problems.append(
                    f"{layer.name}: Weight output_partition_size = {size} is not divisible "
                    f"by weight quantization block_n = {block_n}."
                )
                break
    return problems


def refined_block(
    quant: BlockQuant, local_intermediate: int, hidden: int, tp: int
) -> tuple[int, int] | None:
    """vLLM's `refine_fp8_moe_block_shape`: the finer block its fp8 MoE uses when the
    experts' per-rank intermediate size is not a whole number of checkpoint blocks
    (with the default `moe_backend`)."""
    block_n, block_k = quant.block
    if local_intermediate % block_n == 0 and (tp == 1 or local_intermediate % block_k == 0):
        return None
    refine = math.gcd(block_n, block_k, local_intermediate, hidden)
    return (refine, refine) if refine >= 32 else None


def moe_block_problems(
    quant: BlockQuant, local_intermediate: int, hidden: int, tp: int
) -> list[str]:
    """vLLM's `validate_fp8_block_shape_moe`, reached when no refined block fits, and
    what its loader cannot place on a refined grid."""
    block_k = quant.block[1]
    grid = refined_block(quant, local_intermediate, hidden, tp)
    if grid:
        whole = all((local_intermediate * tp) % b == 0 for b in quant.block)
        if whole:
            return []
        # `_load_w13`/`_load_w2` cut the upsampled checkpoint scales into 1/tp of
        # ceil(I / block) * (block / grid), which then does not fit the parameter's
        # ceil(I/tp / grid) (seen at I = 192, tp = 2: size 3 vs 4).
        return [
            f"vLLM refines the blocks to {list(grid)} for experts of {local_intermediate} "
            f"rows per rank, but its loader cannot place the scales of an intermediate size "
            f"({local_intermediate * tp}) that is not a whole number of {block_k}-blocks."
        ]
    return moe_block_rules(quant.block, local_intermediate, tp)


def moe_block_rules(block: tuple[int, int], local_intermediate: int, tp: int) -> list[str]:
    """vLLM's `validate_fp8_block_shape_moe`, in its words."""
    block_n, block_k = block
    if local_intermediate % block_n:
        return [
            f"The output_size of gate's and up's weight = {local_intermediate} is not "
            f"divisible by weight quantization block_n = {block_n}."
        ]
    if tp > 1 and local_intermediate % block_k:
        return [
            f"The input_size of down's weight = {local_intermediate} is not divisible by "
            f"weight quantization block_k = {block_k}."
        ]
    return []


def _rows_per_rank(rows: int, heads: int, tp: int) -> int:
    if not heads:
        return rows // tp
    first, end = kv_heads_of_rank(heads, tp, 0)
    return rows // heads * (end - first)


def _scale_piece(
    piece: Piece, shapes: Mapping[str, tuple[int, ...]], scheme: BlockQuant, moe_ways: int
) -> Piece:
    shape = matrix(shapes[piece.source], piece.source)
    grid = None
    if piece.expert is not None:  # FusedMoE may refine the blocks of its stacks
        inter = shape[0] if piece.cut is Cut.ROWS else shape[1]
        hidden = shape[1] if piece.cut is Cut.ROWS else shape[0]
        grid = refined_block(scheme, inter // moe_ways, hidden, moe_ways)
    of = ScaleOf(shape, piece.cut, scheme.block, grid, piece.heads)
    return Piece(scale_name(piece.source), Cut.BLOCK_SCALE, expert=piece.expert, scale_of=of)
