"""What a family plug-in is: the records it returns and every hook it may provide.

A target family (`Family`) says, for one Hugging Face architecture, which tensors a
config implies, what keeps a tp from working, and where each tensor goes in vLLM. A
draft family (`DraftFamily`) says the same of a speculative-decoding draft, plus how
to recognize one and what vLLM's `load_weights` does besides copying. Every hook has a
default here, so the callers never probe for one.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardprep.errors import ConfigError
from shardprep.format.records import Topology
from shardprep.plan.cuts import Piece
from shardprep.plan.quant import Scheme
from shardprep.plan.records import FilePlan, ModelPlan, SourceModel

Config = Mapping[str, Any]
Shapes = Mapping[str, tuple[int, ...]]
# The suffix of a tensor that convert computes by dequantizing a stored weight, as vLLM's
# `load_weights` does before copying it (`Family.dequantized_sources`).
DEQUANTIZED = ".dequantized"


@dataclass(frozen=True)
class PlanContext:
    """What a hook knows of the conversion besides the model's own config.json: the options
    of the request that shape a layout and, for a draft, its target. The planner builds
    one per model; a hook called outside a conversion gets DEFAULT_CONTEXT (one stage, no
    draft, no expert parallelism)."""

    pp: int = 1
    expert_parallel: bool = False  # vLLM's --enable-expert-parallel
    dp: int = 1  # vLLM's --data-parallel-size
    mxfp4_pad: str | None = None  # an MXFP4 MoE backend's padding to bake in (--mxfp4-pad)
    # A target's: the method of the draft converted with it; None: no draft.
    draft_method: str | None = None
    # A draft's: its target's config.json as vLLM reads it, its own tensor names (None:
    # not known yet) and its copies of target tensors whose bytes differ from the
    # target's (`DraftFamily.shared_copies`), which it must hold itself.
    target_config: Config = field(default_factory=dict)
    draft_names: tuple[str, ...] | None = None
    distinct_copies: frozenset[str] = frozenset()
    # A target's: whether its draft shares the target's embedding
    # (`DraftFamily.shares_target_embedding`).
    draft_shares_embedding: bool = False
    # A target's: its draft's config.json, when the draft comes with --draft ({}: none).
    # A layout derived from vLLM builds the target beside it (plan/derived).
    draft_config: Config = field(default_factory=dict)
    # The checkpoint's dtype of each of its tensors (safetensors names); empty: not known.
    # A layout derived from vLLM needs them (plan/derived); a family declares its own.
    dtypes: Mapping[str, str] = field(default_factory=dict)


DEFAULT_CONTEXT = PlanContext()


@dataclass(frozen=True)
class Param:
    """One vLLM parameter: its name, the source pieces it is made of, the stages it is on."""

    name: str
    pieces: tuple[Piece, ...]
    stages: tuple[int, ...]
    # A fixed dtype (fp8 weights, float32 scales); None: the model's for a floating-point
    # source, the source's otherwise; MODEL_DTYPE: the model's, cast from any source.
    dtype: str | None = None


@dataclass(frozen=True)
class Layout:
    """Everything a family says about one model for one topology."""

    params: tuple[Param, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)  # source name -> reason
    # (parameter, stage) pairs that vLLM builds only when a speculative draft runs.
    spec_decode_only: frozenset[tuple[str, int]] = frozenset()
    # Parameters a draft may share with the target instead of holding its own.
    shared_with_target: frozenset[str] = frozenset()
    # Source tensors that config.json implies but a checkpoint may leave out.
    optional_sources: frozenset[str] = frozenset()
    # Routed experts per MoE layer (0 for a dense model): sizes the expert stacks.
    num_experts: int = 0
    # Expert groups of grouped routing (config's n_group), which round_robin needs.
    num_expert_group: int | None = None
    # Sources convert computes before they are read, each from a weight and its block
    # scales vLLM dequantizes while loading: {weight + DEQUANTIZED: (weight, scales)}.
    computed: Mapping[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class BuiltinDraft:
    """The draft a target checkpoint carries inside itself (MTP layers, DSpark stages),
    whose tensors the target leaves to it: its draft method and why each is skipped, when
    that draft is converted with the target (`held`) and when it is not (`left_out`)."""

    method: str
    held: str
    left_out: str


@dataclass(frozen=True)
class Count:
    """A count of config.json that a family's hooks enumerate (`key`: `value`) and the
    least a checkpoint must hold for it: `tensors` source tensors of their own, or, for
    units stacked along dim 0 of one tensor per layer (gpt-oss's experts), `value` rows
    in the tensors named by `stacks`."""

    key: str
    value: int
    tensors: int = 0
    stacks: tuple[str, ...] = ()


class Family:
    """A target family. `name` keys its layout revision (format/vllm_layout.py)."""

    name: ClassVar[str]
    # Quantization schemes (plan/quant) whose stored tensors this family places.
    quant_schemes: ClassVar[frozenset[str]] = frozenset()
    # Those of them whose linear layers it does not lay out (only its routed experts).
    experts_only_schemes: ClassVar[frozenset[str]] = frozenset()
    # Why a scheme outside `quant_schemes` is refused, by scheme name ("*": any other),
    # where there is more to say than that its layout is not proven against vLLM.
    quant_refusals: ClassVar[Mapping[str, str]] = {}
    # Whether vLLM's attention layers of the family sit at `{layer}.self_attn.attn`, where
    # vLLM's fp8 weight mapper puts the KV-cache scales a checkpoint ships (plan/quant/
    # kv_cache.py); a family without them refuses such tensors as unknown.
    kv_cache_scales: ClassVar[bool] = False
    # transformers' `attribute_map` of each config class (by model_type) of the family:
    # {attribute: the key it is stored under}. transformers versions rename keys (a
    # Qwen3-MoE saved by transformers 5 holds num_local_experts, not num_experts); vLLM
    # reads either through the class, and so does `read_config`.
    attribute_maps: ClassVar[Mapping[str, Mapping[str, str]]] = {}
    # Why shardprep does not lay out the family's experts as vLLM runs them with expert
    # parallelism; "" when it does. Convert refuses the flag and the loader refuses a
    # vLLM that runs with it (`expert_parallel_problems`).
    expert_parallel_refusal: ClassVar[str] = ""
    # The draft the checkpoint carries, whose tensors (`builtin_draft_tensors`) the planner
    # skips in the target's layout; None: none.
    builtin_draft: ClassVar[BuiltinDraft | None] = None
    # The draft methods vLLM serves with this family as its target, each as a refusal
    # names it; None: every draft the registry holds for it.
    accepted_drafts: ClassVar[Mapping[str, str] | None] = None
    # The embedding parameter that vLLM also builds on the last stage for a draft that
    # shares it at pp > 1 (`spec_decode_needs_target_embed`), which the planner adds there
    # as a spec-decode-only parameter; "": vLLM's target of the family does not share it.
    draft_embedding: ClassVar[str] = ""
    # How refusals name the family ("Kimi-K3").
    label: ClassVar[str] = ""

    def read_config(self, config: Config) -> dict[str, Any]:
        """config.json as transformers' config class reads it: each key of an
        attribute-map pair also under the other name."""
        return with_attribute_map(config, self.attribute_maps.get(str(config.get("model_type"))))

    def counts(self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT) -> list[Count]:
        """Every count that the other hooks enumerate (experts, MTP layers), worked out
        without enumerating anything; a value that is not a whole number is a ConfigError.
        The planner compares each with the checkpoint's headers before calling any other
        hook, so an absurd count is one line, not memory without bound. Decoder layers
        (num_hidden_layers) are compared for every family."""
        return []

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        """Every source tensor the config implies, with its shape (Hugging Face names)."""
        raise NotImplementedError

    def quant_scheme(self, scheme: Scheme) -> Scheme:
        """The scheme (plan/quant) vLLM applies to this family's checkpoint of `scheme`'s
        format: vLLM may load a format through another of its methods for a model
        (Kimi-K3's compressed-tensors MXFP4 through its MXFP4 interface)."""
        return scheme

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        """Problems that make the model unsplittable at this tp, each a full sentence."""
        return []

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        raise NotImplementedError

    def rank_file_problems(
        self, source: SourceModel, model: ModelPlan, files: Sequence[FilePlan], topology: Topology
    ) -> list[str]:
        """What the rank files planned from the family's layout hold otherwise than vLLM,
        where the family can tell (a derived layout under expert parallelism); none here."""
        return []

    def source_dtypes(self, config: Config) -> dict[str, str]:
        """Tensors whose checkpoint dtype is not the model's (a float32 routing bias); what a
        quantization scheme stores is added by plan/archs/parts/quantized.py."""
        return {}

    def quantized_weights(self, config: Config, shapes: Shapes) -> dict[str, str]:
        """Source weights of the layers vLLM builds with the model's quantization (linear
        layers and expert projections), each with the name of its vLLM layer (what an
        ignore list names). A scheme in `quant_schemes` stores these quantized."""
        return {}

    def internal_draft(self, config: Config) -> str | None:
        """The draft method of a draft the checkpoint carries inside itself (MTP layers)."""
        return None

    def builtin_draft_tensors(self, config: Config, shapes: Shapes) -> list[str]:
        """The checkpoint tensors of `builtin_draft`, which the target does not place."""
        return []

    def padded_at_load(self, name: str) -> bool:
        """Whether vLLM may build parameter `name` longer along dim 0 than the rank file's
        tensor on some devices, fill only its front and leave the rest as it initialized
        it (DeepSeek-V4's `attn_sink` on NVIDIA GPUs); the loader then does the same."""
        return False

    def index_ranges(self, config: Config) -> dict[str, tuple[int, int]]:
        """Integer tensors that index something (a hash router's expert table): {source
        name: [low, high)}, the values a tiny model of the family must hold."""
        return {}

    def dequantized_sources(
        self, config: Config, dtypes: Mapping[str, str], shapes: Shapes
    ) -> dict[str, tuple[str, str]]:
        """Weights that vLLM's `load_weights` dequantizes with their block scales before
        copying them into an unquantized layer, given the checkpoint's tensors' dtypes and
        shapes:
        {the name a layout reads the result under (weight + DEQUANTIZED): (weight, its
        scales)}. convert computes them as vLLM does (convert/dequantize.py)."""
        return {}

    # -- inside a vLLM worker: what vLLM's own load_weights does besides copying ----------

    def before_fill(self, model: Any, names: set[str]) -> None:
        """Before the rank's tensors are copied in (`names`: the rank's parameters)."""

    def after_fill(self, model: Any, filled: set[str]) -> None:
        """After every tensor was copied in (`filled`: the parameter names)."""


class DraftFamily(Family):
    """A speculative-decoding draft, registered per (method, target family)."""

    # False: the draft comes inside its target (MTP layers), never with --draft.
    standalone: ClassVar[bool] = True
    # Files besides config and tokenizer that its folder may carry (constants.DRAFT_SIDE_FILES).
    side_files: ClassVar[frozenset[str]] = frozenset()
    # Parameters vLLM may leave at their initial value when the draft lacks them.
    may_stay_unloaded: ClassVar[frozenset[str]] = frozenset()
    # Whether vLLM's draft shares the target's embedding, so that at pp > 1 the target
    # builds it on the last stage too (`Family.draft_embedding`).
    shares_target_embedding: ClassVar[bool] = False

    def carried_by(self, config: Config, names: Collection[str]) -> bool:
        """Whether a target checkpoint whose tensors are `names` carries this built-in
        draft: whether it holds a tensor `expected_shapes` names."""
        return not set(self.expected_shapes(config)).isdisjoint(names)

    def shared_copies(self, config: Config) -> dict[str, str]:
        """Draft tensors that are copies of target tensors (draft name -> target name),
        which vLLM may serve with the target's: left out only when the bytes are equal
        (convert compares them and passes the others as `distinct_copies`)."""
        return {}

    def recognizes(self, config: Config, names: list[str]) -> bool:
        """Whether a draft folder's config and tensor names are of this kind."""
        return False

    def side_tensor_files(self, config: Config) -> dict[str, str]:
        """Tensors vLLM reads from side files (not safetensors): source name -> file."""
        return {}

    def side_tensor(self, name: str, state: Any, config: Config, where: str) -> Any:
        """The tensor `name` from what its side file holds (loaded safely by convert)."""
        raise NotImplementedError

    def example_tables(self, config: Config, *, target_config: Config, seed: int) -> dict:
        """Valid non-random tensors (index tables) for a tiny model of this draft."""
        return {}


def config_int(config: Config, key: str, default: int | None = None) -> int:
    """A size from config.json: a whole number >= 1, else one line naming the key."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ConfigError(f"config.json has no {key}; it is not a complete model config")
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        raise ConfigError(
            f"config.json has {key}: {value!r}, which is not a whole number of at least 1; "
            "fix config.json"
        )
    return int(value)


def config_count(config: Config, key: str, default: int = 0) -> int:
    """A count from config.json that may be 0 (MTP layers, dense first layers): a whole
    number >= 0, else one line naming the key."""
    value = config.get(key)
    if value is None:
        return default
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 0:
        raise ConfigError(
            f"config.json has {key}: {value!r}, which is not a whole number of at least 0; "
            "fix config.json"
        )
    return int(value)


def expert_count(config: Config, key: str, moe_layers: int, *, required: bool = False) -> Count:
    """`key`'s experts in each of `moe_layers` layers, each with three tensors of its own
    (gate, up and down projections); `required`: at least one."""
    experts = config_int(config, key) if required else config_count(config, key)
    return Count(key, experts, 3 * experts * moe_layers)


def with_attribute_map(config: Config, attribute_map: Mapping[str, str] | None) -> dict[str, Any]:
    """`config` with the two names of every `attribute_map` pair holding the same value;
    both given with different values is one line naming them."""
    found = dict(config)
    for attribute, key in (attribute_map or {}).items():
        values = {k: config[k] for k in (attribute, key) if config.get(k) is not None}
        if len({json.dumps(v, sort_keys=True, default=repr) for v in values.values()}) > 1:
            raise ConfigError(
                f"config.json has {attribute}: {values[attribute]!r} and {key}: "
                f"{values[key]!r}, which transformers reads as one setting; keep one of them"
            )
        if values:
            found[attribute] = found[key] = next(iter(values.values()))
    return found


def moe_layers(layers: range, first_dense: int, freq: int) -> int:
    """How many of `layers` hold experts under DeepSeek's rule (`is_moe_layer`: from
    layer `first_dense` on, every `freq`-th), counted without enumerating them."""
    start = max(layers.start, first_dense)
    if layers.stop <= start:
        return 0
    return (layers.stop - 1) // freq - (start - 1) // freq


def expert_parallel_problems(family: Family, ctx: PlanContext) -> list[str]:
    """The family's refusal of `--enable-expert-parallel`, if it is given."""
    if ctx.expert_parallel and family.expert_parallel_refusal:
        return [f"{family.expert_parallel_refusal}; leave --enable-expert-parallel out"]
    return []
