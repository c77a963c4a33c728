"""Pure arithmetic of tensor and pipeline parallelism, as vLLM does it.

No environment reads here: callers resolve `VLLM_PP_LAYER_PARTITION` once at the edge
and pass the explicit partition in.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardprep.constants import VOCAB_PADDING
from shardprep.errors import PlanError
from shardprep.format.records import Topology

__all__ = ["ExpertSplit", "Topology", "make_topology", "pad_vocab"]


def default_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """vLLM's `get_pp_indices`: `n // pp` layers each; the remainder goes one each to
    the second-to-last stage, then the third-to-last, and so on, never to the last.

    >>> default_partition(10, 4)
    (2, 3, 3, 2)
    """
    if pp < 1:
        raise PlanError(f"pipeline parallel size must be at least 1, got {pp}")
    if num_layers < pp:
        raise PlanError(
            f"the model has {num_layers} layers, fewer than pp={pp} stages; use a smaller --pp"
        )
    sizes = [num_layers // pp] * pp
    remainder = num_layers % pp
    for i in range(remainder):
        sizes[pp - 2 - i] += 1
    return tuple(sizes)


def parse_partition(text: str, num_layers: int, pp: int, origin: str = "") -> tuple[int, ...]:
    """Check an explicit partition such as "31,30" the way vLLM does. `origin` names
    where it came from when that is not the command line (an environment variable)."""
    what = f"layer partition {text!r}" + (f" from {origin}" if origin else "")
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        example = ",".join(map(str, default_partition(num_layers, pp))) if pp >= 1 else "31,30"
        raise PlanError(
            f"{what} is not a comma-separated list of integers; write it as e.g. {example}"
        ) from None
    if len(sizes) != pp:
        raise PlanError(f"{what} has {len(sizes)} entries but pp={pp}")
    if sum(sizes) != num_layers:
        raise PlanError(
            f"{what} sums to {sum(sizes)} but the model has "
            f"{num_layers} layers; make the entries add up to {num_layers}"
        )
    if min(sizes) < 1:
        raise PlanError(f"{what} leaves a stage without layers")
    return sizes


def make_topology(
    num_layers: int, tp: int, pp: int, partition: str | None = None, origin: str = ""
) -> Topology:
    if tp < 1:
        raise PlanError(f"tensor parallel size must be at least 1, got {tp}")
    sizes = (
        parse_partition(partition, num_layers, pp, origin)
        if partition
        else default_partition(num_layers, pp)
    )
    return Topology(tp=tp, pp=pp, partition=sizes)


def pad_vocab(vocab_size: int, multiple: int = VOCAB_PADDING) -> int:
    """Round up to a multiple of `multiple` (vLLM's `pad_vocab_size`)."""
    return -(-vocab_size // multiple) * multiple


def even_split(size: int, tp: int, what: str) -> int:
    """The per-rank share of `size`, which must divide by tp."""
    if size % tp:
        raise PlanError(f"{what} ({size}) is not divisible by tp={tp}; choose a tp that divides it")
    return size // tp


def rank_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    """The [start, end) block of rank `rank` when `size` splits evenly over tp."""
    per = size // tp
    return rank * per, (rank + 1) * per


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """[first, end) of the KV heads that rank `rank` holds.

    When tp >= num_kv_heads, each rank holds one head, replicated over tp/num_kv_heads
    ranks; otherwise each holds num_kv_heads/tp heads.
    """
    if tp >= num_kv_heads:
        if tp % num_kv_heads:
            raise PlanError(
                f"tp={tp} is not a multiple of the {num_kv_heads} KV heads; "
                "choose a tp that divides or is a multiple of the KV heads"
            )
        head = rank // (tp // num_kv_heads)
        return head, head + 1
    per = even_split(num_kv_heads, tp, "the number of KV heads")
    return rank * per, (rank + 1) * per


EXPERT_PLACEMENTS = ("linear", "round_robin")
# vLLM's all2all backends that carry round-robin routing tables.
ROUND_ROBIN_ALL2ALL = ("deepep_low_latency", "nixl_ep")
DEFAULT_ALL2ALL = "allgather_reducescatter"


@dataclass(frozen=True)
class ExpertSplit:
    """How vLLM's FusedMoE spreads the routed experts of a layer over tp x dp ranks
    (`FusedMoEParallelConfig.make`). The MoE rank of (dp_rank, tp_rank) is
    dp_rank * tp + tp_rank. Without expert parallelism every MoE rank holds every
    expert, cut tp x dp ways; with it, each holds whole experts of its own range
    (`placement`, the strategy vLLM actually uses: see `effective_placement`)."""

    num_experts: int
    tp: int
    dp: int = 1
    expert_parallel: bool = False
    placement: str = "linear"

    @property
    def size(self) -> int:
        return self.tp * self.dp

    @property
    def uses_ep(self) -> bool:
        """vLLM turns expert parallelism on only when there is more than one MoE rank."""
        return self.expert_parallel and self.size > 1

    def moe_rank(self, tp_rank: int, dp_rank: int = 0) -> int:
        return dp_rank * self.tp + tp_rank

    def experts(self, moe_rank: int) -> tuple[int, ...]:
        """The global ids of the experts MoE rank `moe_rank` holds, in local order."""
        if not self.uses_ep:
            return tuple(range(self.num_experts))
        return experts_of_rank(self.num_experts, self.size, moe_rank, self.placement)

    def cut(self, moe_rank: int) -> tuple[int, int]:
        """(ways, index): how each held expert is cut; (1, 0) means whole experts."""
        return (1, 0) if self.uses_ep else (self.size, moe_rank)


def experts_of_rank(
    num_experts: int, ep_size: int, ep_rank: int, placement: str
) -> tuple[int, ...]:
    """vLLM's `determine_expert_map`: `num_experts // ep_size` experts each, one more on
    each of the first `num_experts % ep_size` ranks. `linear` gives contiguous ranges;
    `round_robin` gives rank r the experts r, r + ep_size, ...

    >>> experts_of_rank(10, 4, 1, "linear"), experts_of_rank(10, 4, 1, "round_robin")
    ((3, 4, 5), (1, 5, 9))
    """
    if not 0 <= ep_rank < ep_size:
        raise PlanError(f"expert-parallel rank {ep_rank} is outside 0..{ep_size - 1}")
    base, remainder = divmod(num_experts, ep_size)
    count = base + 1 if ep_rank < remainder else base
    if placement == "linear":
        start = ep_rank * base + min(ep_rank, remainder)
        return tuple(range(start, start + count))
    if placement == "round_robin":
        return tuple(range(ep_rank, num_experts, ep_size))
    raise PlanError(
        f"expert placement {placement!r} is unknown; choose one of {', '.join(EXPERT_PLACEMENTS)}"
    )


def effective_placement(
    requested: str,
    *,
    num_expert_group: int | None,
    dp: int,
    all2all_backend: str = DEFAULT_ALL2ALL,
) -> str:
    """The placement vLLM uses when `requested` is asked for under expert parallelism
    (`determine_expert_placement_strategy`): `round_robin` holds only for grouped routing
    (`n_group` > 1; no redundant experts, EPLB off) and, when dp > 1 makes vLLM use
    all2all kernels, only with an all2all backend that has round-robin routing tables.
    Otherwise vLLM falls back to `linear` (with a warning)."""
    if requested not in EXPERT_PLACEMENTS:
        raise PlanError(
            f"expert placement {requested!r} is unknown; "
            f"choose one of {', '.join(EXPERT_PLACEMENTS)}"
        )
    if requested == "linear":
        return "linear"
    if not num_expert_group or num_expert_group <= 1:
        return "linear"
    if dp > 1 and all2all_backend not in ROUND_ROBIN_ALL2ALL:
        return "linear"
    return "round_robin"
