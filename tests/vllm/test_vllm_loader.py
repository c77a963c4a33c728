"""The `sharded-fast` vLLM loader: its checks without an engine, then a real vLLM (CPU).

Greedy tokens through `--load-format sharded-fast` equal those of Hugging Face
transformers (and so of vLLM's default loader) on the original model at tp1, tp2, pp2 and
tp2 x pp2 (float32: token for token), for Qwen3 too at tp2 x pp2, with an EAGLE3 draft
too; a topology mismatch fails with one clear line. vLLM's stock
`sharded_state` loader reads the same rank files once the attention scale buffers are
added (why it needs them, and why it cannot take every artifact, is tested here too).
Converted artifacts and the baseline are shared by the whole module, to keep the
number of vLLM runs small.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm_env
from safetensors.torch import load_file, save_file
from torch import nn

from shardprep.constants import MANIFEST_NAME, VLLM_SHARDED_STATE_PATTERN
from shardprep.convert.run import Options, convert
from shardprep.errors import (
    ConfigError,
    ManifestError,
    TopologyMismatchError,
    WeightMismatchError,
)
from shardprep.format.manifest import read_manifest
from shardprep.plan import archs

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
plugin = pytest.importorskip("shardprep.loader.plugin", reason="needs vLLM importable")
checks = pytest.importorskip("shardprep.loader.checks", reason="needs vLLM importable")
filling = pytest.importorskip("shardprep.loader.fill", reason="needs vLLM importable")

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
WITH_DRAFT = {(2, 1), (2, 2)}
# The CPU attention backend needs a head size that is a multiple of 32. EAGLE3 reads the
# target's states after layers 1, 2 and 3 (vLLM's default picks collide on 4 layers).
MODEL_CONFIG = {"hidden_size": 128, "head_dim": 32}
DRAFT_CONFIG = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}


class Artifacts:
    """One tiny Llama (float32) and its EAGLE3 draft, converted once per layout."""

    def __init__(self, tiny, root: Path) -> None:
        self.model = tiny.model("vllm-llama", **MODEL_CONFIG)
        self.draft = tiny.draft("vllm-eagle3", self.model, **DRAFT_CONFIG)
        self.root = root
        self._done: dict[tuple[int, int, bool], Path] = {}

    def get(self, tp: int, pp: int, draft: bool | None = None) -> Path:
        draft = (tp, pp) in WITH_DRAFT if draft is None else draft
        key = (tp, pp, draft)
        if key not in self._done:
            out = self.root / f"tp{tp}-pp{pp}{'-draft' if draft else ''}"
            options = Options(
                tp=tp, pp=pp, draft=str(self.draft) if draft else None, dtype="float32"
            )
            convert(str(self.model), out, options, progress=False)
            self._done[key] = out
        return self._done[key]


@pytest.fixture(scope="module")
def artifacts(tiny, tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    return Artifacts(tiny, tmp_path_factory.mktemp("vllm-artifacts"))


@pytest.fixture(scope="module")
def baseline(artifacts: Artifacts) -> list[list[int]]:
    """Hugging Face transformers on the original checkpoint (float32), which vLLM's default
    loader equals token for token (tests/vllm/test_vllm_harness.py)."""
    return vllm_env.transformers_greedy(artifacts.model, vllm_env.DEFAULT_PROMPTS, 8)


# --- without an engine ------------------------------------------------------------------


def test_register_is_idempotent() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    plugin.register()
    plugin.register()
    loader = get_model_loader(LoadConfig(load_format="sharded-fast"))
    assert type(loader) is plugin.ShardedFastLoader
    assert loader.options == plugin.LoaderOptions(verify=False)


def test_extra_config_keys_are_checked() -> None:
    assert plugin.LoaderOptions.from_extra_config({"verify": True}).verify is True
    assert plugin.LoaderOptions.from_extra_config({}).gds is None
    assert plugin.LoaderOptions.from_extra_config({"gds": False}).gds is False
    with pytest.raises(ConfigError) as info:
        plugin.LoaderOptions.from_extra_config({"pattern": "x", "verify": True})
    assert str(info.value) == (
        "--model-loader-extra-config has unknown key(s) ['pattern'] for --load-format "
        "sharded-fast; the allowed keys are ['gds', 'verify']"
    )
    with pytest.raises(ConfigError, match="'verify' must be true or false"):
        plugin.LoaderOptions.from_extra_config({"verify": "yes"})
    with pytest.raises(ConfigError, match="'gds' must be true or false"):
        plugin.LoaderOptions.from_extra_config({"gds": 1})


class Toy(nn.Module):
    """A model with a tied head, as vLLM builds one: `lm_head` is `embed`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.proj = nn.Linear(2, 3, bias=False)
        self.norm = nn.LayerNorm(2, bias=False)
        self.lm_head = self.embed
        self.register_buffer("scale", torch.tensor(1.0))


def toy_tensors(**changes: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    tensors = {
        "embed.weight": torch.arange(8.0).view(4, 2),
        "proj.weight": torch.ones(3, 2),
        "norm.weight": torch.full((2,), 2.0),
    }
    tensors.update(changes)
    return [(name, t) for name, t in tensors.items() if t is not None]


def fill(model: nn.Module, tensors, **kw) -> list[str]:
    kw = {"ignorable": set(), "may_lack": set(), "where": "OUT (target, rank pp0 tp0)", **kw}
    return filling.fill_parameters(model, tensors, layout="vllm-0.32/1", **kw)


def test_fill_copies_every_parameter_once() -> None:
    model = Toy()
    filled = fill(model, toy_tensors())
    assert sorted(filled) == ["embed.weight", "norm.weight", "proj.weight"]
    assert torch.equal(model.lm_head.weight, torch.arange(8.0).view(4, 2))
    assert torch.equal(model.norm.weight, torch.full((2,), 2.0))


def test_fill_accepts_a_tied_alias_and_the_allowed_gaps() -> None:
    model = Toy()
    tensors = toy_tensors(**{"embed.weight": None, "lm_head.weight": torch.ones(4, 2)})
    tensors.append(("model.embed_tokens.weight", torch.ones(1)))  # spec-decode only
    tensors.append(("scale", torch.tensor(3.0)))  # a buffer may be filled, not required
    filled = fill(model, tensors, ignorable={"model.embed_tokens.weight"})
    assert "lm_head.weight" in filled and torch.equal(model.embed.weight, torch.ones(4, 2))
    assert model.scale.item() == 3.0
    assert fill(Toy(), toy_tensors(**{"embed.weight": None}), may_lack={"lm_head.weight"})


def test_fill_skips_the_tensors_of_a_part_vllm_left_unbuilt() -> None:
    """A tower whose modalities are all off becomes vLLM's `StageMissingLayer` (built under
    `_mark_tower_model`): its tensors are skipped, as vLLM's loader skips them; a tensor
    of a name that merely starts alike is still one the model does not have."""
    from vllm.model_executor.models.utils import StageMissingLayer

    model = Toy()
    model.visual = StageMissingLayer("vision_tower", nn.Linear(2, 2))
    tower = [("visual.proj.weight", torch.ones(2, 2)), ("visual.norm.bias", torch.ones(2))]
    assert sorted(fill(model, toy_tensors() + tower)) == sorted(fill(Toy(), toy_tensors()))
    with pytest.raises(WeightMismatchError, match=r"1 tensor\(s\) .* \(visualize.weight\)"):
        fill(model, [*toy_tensors(), *tower, ("visualize.weight", torch.ones(1))])


def test_destinations_hand_out_each_fitting_parameter_once() -> None:
    """What the reader may read straight into on the CPU: a parameter of the exact shape
    and dtype, once (not again by a tied alias); the rest gets None and fill_parameters
    judges it as before. A tensor read into its parameter is filled without a copy."""
    from shardprep.format.headers import TensorInfo

    model = Toy()
    into = filling.Destinations(model)

    def info(*shape: int) -> TensorInfo:
        return TensorInfo("F32", shape, 0, 4)

    embed = into("embed.weight", info(4, 2))
    assert embed is not None and embed.data_ptr() == model.embed.weight.data_ptr()
    assert into("lm_head.weight", info(4, 2)) is None  # its alias was handed out
    assert into("proj.weight", info(2, 2)) is None  # wrong shape
    assert into("norm.weight", TensorInfo("F64", (2,), 0, 16)) is None  # wrong dtype
    assert into("extra.weight", info(1)) is None
    embed.copy_(torch.arange(8.0).view(4, 2))
    filled = fill(model, toy_tensors(**{"embed.weight": embed}))
    assert "embed.weight" in filled
    assert torch.equal(model.lm_head.weight, torch.arange(8.0).view(4, 2))


def test_fill_reports_every_problem_once() -> None:
    tensors = [
        ("extra.weight", torch.ones(1)),
        ("embed.weight", torch.ones(4, 2)),
        ("lm_head.weight", torch.ones(4, 2)),  # the same parameter again, by its alias
        ("proj.weight", torch.ones(2, 2)),
        ("norm.weight", torch.ones(2, dtype=torch.float64)),
    ]
    with pytest.raises(WeightMismatchError) as info:
        fill(Toy(), tensors)
    assert str(info.value) == (
        "the rank files of OUT (target, rank pp0 tp0) do not fit the model vLLM built: "
        "1 tensor(s) the model does not have (extra.weight); "
        "1 parameter(s) filled more than once (lm_head.weight); "
        "1 shape mismatch(es) (proj.weight: file (2, 2), model (3, 2)); "
        "1 dtype mismatch(es) (norm.weight: file torch.float64, model torch.float32). "
        "They follow vLLM layout vllm-0.32/1; convert again with a shardprep that matches "
        "this vLLM, or load the original model with --load-format auto"
    )
    with pytest.raises(WeightMismatchError) as info:
        fill(Toy(), toy_tensors()[:1])
    assert "2 parameter(s) missing from the files (proj.weight, norm.weight)" in str(info.value)


def test_draft_flags_follow_the_files() -> None:
    from vllm.model_executor.models.interfaces import SupportsEagle3

    class Draft(nn.Module, SupportsEagle3):
        pass

    draft = Draft()
    eagle3 = archs.draft_family("eagle3", "llama")
    eagle3.after_fill(draft, {"model.layers.0.mlp.down_proj.weight", "lm_head.weight"})
    assert draft.has_own_lm_head is True and draft.has_own_embed_tokens is False
    # The flags are EAGLE's: vLLM's DeepSeek MTP draft has none, and none is set on it.
    mtp = Draft()
    archs.draft_family("mtp", "deepseek").after_fill(mtp, {"lm_head.weight"})
    assert "has_own_lm_head" not in vars(mtp)


def place(tp: int, pp: int, pp_rank: int = 0) -> checks.RankPlace:
    return checks.RankPlace(pp_rank=pp_rank, pp_size=pp, tp_rank=0, tp_size=tp)


def test_topology_mismatch_names_both_sides(artifacts: Artifacts) -> None:
    out = artifacts.get(2, 2)
    with pytest.raises(TopologyMismatchError) as info:
        checks.check_topology(out, read_manifest(out), place(4, 2))
    assert str(info.value) == (
        f"artifact {out} is tp2 x pp2 but vLLM runs tp4 x pp2; re-run `shardprep convert "
        f"{artifacts.model} --tp 4 --pp 2 -o NEW` or start vLLM with "
        "--tensor-parallel-size 2 --pipeline-parallel-size 2"
    )
    checks.check_topology(out, read_manifest(out), place(2, 2))


def test_dtype_mismatch_says_which_flag_to_change(artifacts: Artifacts) -> None:
    out = artifacts.get(1, 1)
    entry = read_manifest(out).model("target")
    with pytest.raises(TopologyMismatchError) as info:
        checks.check_dtype(out, entry, torch.bfloat16)
    assert str(info.value) == (
        f"artifact {out} holds float32 weights but vLLM runs torch.bfloat16; start vLLM "
        "with --dtype float32, or convert again with `shardprep convert --dtype bfloat16`"
    )
    checks.check_dtype(out, entry, torch.float32)


def test_layer_range_mismatch_names_both_partitions(artifacts: Artifacts) -> None:
    out = artifacts.get(1, 2)
    manifest = read_manifest(out)
    checks.check_layers(out, manifest, place(1, 2, 1), (2, 4), (2, 2))
    with pytest.raises(TopologyMismatchError) as info:
        checks.check_layers(out, manifest, place(1, 2, 1), (3, 4), (3, 1))
    assert str(info.value) == (
        f"artifact {out} puts layers 2-3 on stage 1 (partition 2,2) but vLLM built layers "
        "3-3 there (partition 3,1); start vLLM with VLLM_PP_LAYER_PARTITION=2,2, or convert "
        "again with VLLM_PP_LAYER_PARTITION=3,1 set"
    )


def config_of(path: Path) -> SimpleNamespace:
    return SimpleNamespace(model=str(path), model_weights="")


def test_role_and_artifact_from_vllm_config(
    artifacts: Artifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.config

    out = artifacts.get(2, 1)
    target, draft, mtp = config_of(out), config_of(out / "draft"), config_of(out)
    current = SimpleNamespace(model_config=target, speculative_config=None)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)
    assert plugin.model_role(target) == "target"
    for spec_model in (draft, mtp):  # a draft may live in the target's own folder
        current.speculative_config = SimpleNamespace(draft_model_config=spec_model)
        role = plugin.model_role(spec_model)
        assert role == "draft"
        assert plugin.find_artifact(plugin.model_path(spec_model), role) == out


def test_role_from_the_layout_without_a_current_config(
    artifacts: Artifacts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.config

    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    out = artifacts.get(2, 1)
    assert plugin.model_role(config_of(out)) == "target"
    assert plugin.model_role(config_of(out / "draft")) == "draft"
    with pytest.raises(ManifestError) as info:
        plugin.find_artifact(tmp_path, "target")
    assert str(info.value).startswith(f"{tmp_path} has no {MANIFEST_NAME}, so it is not")
    assert "`shardprep convert MODEL -o OUT --tp T --pp P`" in str(info.value)


# --- a real vLLM ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_sharded_fast_generates_what_the_default_loader_does(
    artifacts: Artifacts, baseline: list[list[int]], tp: int, pp: int
) -> None:
    out = artifacts.get(tp, pp)  # tp2 and tp2 x pp2 also hold a draft, unused here
    extra = {"verify": True} if (tp, pp) == (2, 2) else None
    tokens = vllm_env.generate(out, tp, pp, "sharded-fast", model_loader_extra_config=extra)
    assert tokens == baseline


@pytest.mark.slow
def test_another_family_generates_through_sharded_fast_at_tp2_pp2(tiny, tmp_path: Path) -> None:
    """Qwen3 (qk-norm, no bias). The loader fills parameters by name whatever the family,
    and each family's rank files equal vLLM's own state (test_vllm_layout.py), so one
    family besides Llama stands for the others here."""
    arch = "Qwen3ForCausalLM"
    model = tiny.model(f"vllm-{arch}", arch, **MODEL_CONFIG)
    out = tmp_path / "artifact"
    convert(str(model), out, Options(tp=2, pp=2, dtype="float32"), progress=False)
    tokens = vllm_env.generate(out, 2, 2, "sharded-fast")
    assert tokens == vllm_env.transformers_greedy(model, vllm_env.DEFAULT_PROMPTS, 8)


@pytest.mark.slow
def test_eagle3_draft_loads_through_sharded_fast(
    artifacts: Artifacts, baseline: list[list[int]]
) -> None:
    out = artifacts.get(2, 1, draft=True)
    spec = {"method": "eagle3", "model": str(out / "draft"), "num_speculative_tokens": 2}
    tokens = vllm_env.generate(out, 2, 1, "sharded-fast", speculative_config=spec)
    assert tokens == baseline  # greedy speculative decoding is lossless


@pytest.mark.slow
def test_topology_mismatch_fails_with_one_clear_line(artifacts: Artifacts) -> None:
    """A tp1 artifact serves no tp2 rank (a coarser tp is cut from a finer artifact only)."""
    out = artifacts.get(1, 1)
    with pytest.raises(vllm_env.VllmRunError) as info:
        vllm_env.generate(out, 2, 1, "sharded-fast", timeout=300)
    assert (
        f"artifact {out} is tp1 x pp1 and serves tp 1 x any pp; vLLM runs tp2 x pp1, which "
        "it cannot serve (tp2 is not a divisor of the artifact's tp1)"
    ) in str(info.value)


@pytest.mark.slow
def test_stock_sharded_state_misses_the_attention_scale_buffers(artifacts: Artifacts) -> None:
    """Why stock `sharded_state` cannot load an artifact as it is: it requires every entry
    of `model.state_dict()`, which besides the parameters holds the persistent buffers
    `_k_scale`, `_v_scale`, `_q_scale` and `_prob_scale` of each attention layer; rank
    files hold the parameters only (what the default loader fills)."""
    out = artifacts.get(1, 2, draft=False)
    config = {"pattern": VLLM_SHARDED_STATE_PATTERN}
    with pytest.raises(vllm_env.VllmRunError) as info:
        vllm_env.generate(out, 1, 2, "sharded_state", model_loader_extra_config=config)
    assert "ValueError: Missing keys ('model.layers.0.self_attn.attn._k_scale'" in str(info.value)


@pytest.mark.slow
def test_stock_sharded_state_loads_the_rank_files_with_the_scales_added(
    artifacts: Artifacts, baseline: list[list[int]], tmp_path: Path
) -> None:
    """With those buffers added (float32 1.0, as vLLM initializes them), the same rank
    files load with stock `sharded_state` and the {pp_rank} pattern, token for token."""
    out = with_attention_scales(artifacts.get(2, 2, draft=False), tmp_path / "with-scales")
    config = {"pattern": VLLM_SHARDED_STATE_PATTERN}
    tokens = vllm_env.generate(out, 2, 2, "sharded_state", model_loader_extra_config=config)
    assert tokens == baseline


ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
ATTENTION_LAYER = re.compile(r"model\.layers\.(\d+)\.self_attn\.")


def with_attention_scales(artifact: Path, out: Path) -> Path:
    """A copy of a one-part-per-rank artifact whose rank files also hold the attention
    scale buffers of their layers."""
    shutil.copytree(artifact, out)
    for entry in read_manifest(out).files:
        tensors = load_file(out / entry.path)
        layers = {int(m[1]) for name in tensors if (m := ATTENTION_LAYER.match(name))}
        for layer, scale in itertools.product(sorted(layers), ATTENTION_SCALES):
            tensors[f"model.layers.{layer}.self_attn.attn.{scale}"] = torch.tensor(1.0)
        save_file(tensors, out / entry.path)
    return out


def fake_ranks(monkeypatch: pytest.MonkeyPatch, tp: int, pp: int, pp_rank: int = 0) -> None:
    import vllm.distributed as distributed

    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(distributed, "get_pipeline_model_parallel_rank", lambda: pp_rank)
    monkeypatch.setattr(distributed, "get_pp_group", lambda: SimpleNamespace(world_size=pp))
    monkeypatch.setattr(distributed, "get_tp_group", lambda: SimpleNamespace(world_size=tp))


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_stock_sharded_state_takes_the_pattern_only_with_pp(
    monkeypatch: pytest.MonkeyPatch, tp: int, pp: int
) -> None:
    """Why stock vLLM cannot load a pp=1 artifact with the {pp_rank} pattern: its
    `_render_default_pattern` refuses a pp_rank field when the pipeline size is 1 (a
    pattern with a literal `pp-0` works there, and is refused at pp > 1)."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    fake_ranks(monkeypatch, tp, pp)
    render = ShardedStateLoader._render_default_pattern
    literal = VLLM_SHARDED_STATE_PATTERN.replace("{pp_rank}", "0")
    if pp > 1:
        assert (
            render(VLLM_SHARDED_STATE_PATTERN, part="*")
            == "shards/model-pp-0-tp-0-part-*.safetensors"
        )
        with pytest.raises(ValueError, match="does not embed the pipeline parallel rank"):
            render(literal, part="*")
    else:
        with pytest.raises(ValueError, match="requires pipeline parallelism"):
            render(VLLM_SHARDED_STATE_PATTERN, part="*")
        assert render(literal, part="*") == "shards/model-pp-0-tp-0-part-*.safetensors"


def test_stock_sharded_state_cannot_skip_spec_decode_only_tensors(
    artifacts: Artifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why stock vLLM cannot load the last stage of a pp > 1 artifact converted with a
    draft unless the draft runs: that stage's files hold the embedding vLLM builds only
    for an EAGLE draft, and `sharded_state` looks every file tensor up in the model."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    out = artifacts.get(2, 2, draft=True)
    manifest = read_manifest(out)
    target = manifest.model("target")
    only_with_draft = {name for name, stage in target.spec_decode_only if stage == 1}
    assert only_with_draft == {"model.embed_tokens.weight"}
    fake_ranks(monkeypatch, 2, 2, pp_rank=1)
    specs = target.ranks["pp1-tp0"]
    state = {n: torch.empty(s.shape) for n, s in specs.items() if n not in only_with_draft}
    model = SimpleNamespace(state_dict=lambda: dict(state))
    config = SimpleNamespace(model=str(out), model_weights="")
    loader = ShardedStateLoader(
        LoadConfig(load_format="sharded_state",
                   model_loader_extra_config={"pattern": VLLM_SHARDED_STATE_PATTERN})
    )  # fmt: skip
    with pytest.raises(KeyError, match="model.embed_tokens.weight"):
        loader.load_weights(model, config)
    state["model.embed_tokens.weight"] = torch.empty(specs["model.embed_tokens.weight"].shape)
    loader.load_weights(model, config)  # with the draft's embedding built, it loads


def test_the_sharded_state_pattern_names_the_rank_files(artifacts: Artifacts) -> None:
    out = artifacts.get(2, 2, draft=False)
    for entry in read_manifest(out).files:
        rendered = VLLM_SHARDED_STATE_PATTERN.format(
            pp_rank=entry.pp, tp_rank=entry.tp, part=entry.part
        )
        assert rendered == entry.path
