"""fp8 block quantization (`quantization_config.quant_method: fp8` with
`weight_block_size`), as vLLM's `Fp8LinearMethod` builds and checks it: weights stay fp8,
each has a float32 `weight_scale_inv` of one scale per block."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

Config = Mapping[str, Any]


@dataclass(frozen=True)
class BlockQuant:
    name: ClassVar[str] = "fp8_block"  # the scheme, which keys its layout revision
    method: ClassVar[str] = "fp8"  # vLLM's quantization method

    block: tuple[int, int]  # (block_n: output rows, block_k: input columns)
    problem: str = ""  # why vLLM cannot load this quantization, if it cannot

    def scale_shape(self, weight: tuple[int, int]) -> tuple[int, int]:
        return -(-weight[0] // self.block[0]), -(-weight[1] // self.block[1])


def block_quant(config: Config) -> BlockQuant | None:
    """The block quantization config.json declares, or None for an unquantized model."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method != "fp8" or not block:
        what = f"quant_method {method!r}" + ("" if block else " without weight_block_size")
        return BlockQuant((1, 1), f"quantization_config has {what}; shardprep supports fp8 blocks")
    if quant.get("activation_scheme", "dynamic") != "dynamic" or len(block) != 2:
        return BlockQuant((1, 1), "fp8 blocks need activation_scheme dynamic and a 2-D block")
    return BlockQuant((int(block[0]), int(block[1])))


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
    """vLLM's `validate_fp8_block_shape_moe`, reached when no refined block fits."""
    if refined_block(quant, local_intermediate, hidden, tp):
        return []
    block_n, block_k = quant.block
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
