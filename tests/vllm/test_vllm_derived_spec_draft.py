"""An EAGLE3 draft beside an architecture no family module names (Granite), both derived
from vLLM's own model definition (plan/derived), in a real vLLM (CPU build): converted at
tp2 x pp2, every rank file of the target and of the draft (on the last stage only)
equals what vLLM's default loader leaves in memory with `--speculative-config
'{"method": "eagle3", ...}'`, byte for byte; `sharded-fast`, every collective trapped,
leaves the same state and the same flags (the draft family of a derived target sets
them as vLLM's EAGLE3 `load_weights` does). The CPU engine fails after loading a draft at
pp > 1, which leaves the state complete."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_env
from canary import FLAGS, TRAP, assert_same_state, loaded, rank_dumps
from derived_models import COMMON, make_transformers_model

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.format.manifest import read_manifest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
]
# Six layers put the auxiliary layers 4, 5, 6 on the last stage (the CPU engine passes no
# auxiliary states between stages).
LAYERS = 6
AUX = {"eagle_aux_hidden_state_layer_ids": [4, 5, 6]}


def test_derived_eagle3_draft_rank_files_equal_vllm_draft_state(tmp_path: Path) -> None:
    sizes = {"num_hidden_layers": LAYERS, "vocab_size": 1001}
    model = make_transformers_model(tmp_path / "model", "GraniteForCausalLM", **sizes)
    # The draft's sizes are the target's: made for a Llama of Granite's sizes.
    like = {k: COMMON[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")}
    like |= {k: COMMON[k] for k in ("head_dim", "intermediate_size")} | sizes
    stand_in = make_tiny_model(tmp_path / "sizes", "LlamaForCausalLM", **like)
    draft = make_tiny_draft(tmp_path / "draft", stand_in, "eagle3", **AUX)
    artifact = tmp_path / "artifact"
    options = Options(tp=2, pp=2, draft=str(draft), dtype="float32")
    convert(str(model), artifact, options, progress=False)
    manifest = read_manifest(artifact)
    assert manifest.vllm_layout.revisions == {"derived": 1}  # the target's and the draft's
    assert [(m.role, m.method) for m in manifest.models] == [("target", None), ("draft", "eagle3")]
    assert {(f.role, f.pp) for f in manifest.files if f.role == "draft"} == {("draft", 1)}
    shared = set(manifest.model("draft").shared_with_target)
    assert shared == {"model.embed_tokens.weight", "lm_head.weight"}

    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    dumps = vllm_env.dump_state(
        model, 2, 2, tmp_path / "dump", speculative_config=spec, allow_engine_failure=True
    )
    for rank in rank_dumps(dumps, artifact, tp=2, pp=2, draft=True):
        if rank.role == "draft":
            assert "draft_id_to_target_id" in rank.ours  # its own, smaller vocabulary
        assert_same_state(loaded(rank.state, rank.meta, shared), rank.ours)

    spec["model"] = str(artifact / "draft")
    fast = vllm_env.dump_state(
        artifact, 2, 2, tmp_path / "fast", speculative_config=spec, env=TRAP,
        allow_engine_failure=True, load_format="dump-sharded-fast",
    )  # fmt: skip
    assert fast.keys() == dumps.keys()
    for rank in rank_dumps(fast):
        default_state, meta = vllm_env.read_dump(dumps[rank.key])
        assert [rank.meta[f] for f in FLAGS] == [meta[f] for f in FLAGS]
        assert_same_state(loaded(default_state, meta, shared), loaded(rank.state, meta, shared))
