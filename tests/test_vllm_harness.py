"""Real-vLLM tests of the harness itself (tests/vllm_env.py, vllm_runner.py, dump plugin).

Tiny random Llama (hidden 128, 4 heads of 32: the CPU attention needs head_dim >= 32),
float32, generated in a temporary folder. Each test starts one vLLM (15-60 s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="no vLLM python found"),
]

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 4, 2, 32, 1000
PADDED_VOCAB = 1024  # multiple of 64
DRAFT_VOCAB = 500  # EAGLE3 draft vocabulary (padded to 512 in vLLM)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
MAX_TOKENS = 8
LAYER_PARAMS = (
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.o_proj.weight",
    "self_attn.qkv_proj.weight",
)


def make_llama(path: Path, num_layers: int = 4, tie: bool = False) -> Path:
    """A tiny random LlamaForCausalLM checkpoint (safetensors, float32)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    return path


def _rand(gen: Any, *shape: int) -> Any:
    return torch.randn(*shape, generator=gen) * 0.05


def _draft_layer(gen: Any, prefix: str, in_features: int) -> dict[str, Any]:
    """One Llama decoder layer in Hugging Face names (no input_layernorm)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(gen, q, in_features),
        f"{prefix}.self_attn.k_proj.weight": _rand(gen, kv, in_features),
        f"{prefix}.self_attn.v_proj.weight": _rand(gen, kv, in_features),
        f"{prefix}.self_attn.o_proj.weight": _rand(gen, HIDDEN, q),
        f"{prefix}.mlp.gate_proj.weight": _rand(gen, INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": _rand(gen, INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": _rand(gen, HIDDEN, INTER),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
    }


def _draft_config(**extra: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **extra,
    }


def make_eagle3_draft(path: Path, aux_layer_ids: list[int]) -> Path:
    """A tiny EAGLE3 draft named like yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (no embed_tokens)."""
    gen = torch.Generator().manual_seed(1)
    tensors = _draft_layer(gen, "midlayer", 2 * HIDDEN)
    tensors["midlayer.input_layernorm.weight"] = torch.ones(HIDDEN)
    tensors["midlayer.hidden_norm.weight"] = torch.ones(HIDDEN)
    tensors["fc.weight"] = _rand(gen, HIDDEN, 3 * HIDDEN)
    tensors["norm.weight"] = torch.ones(HIDDEN)
    tensors["lm_head.weight"] = _rand(gen, DRAFT_VOCAB, HIDDEN)
    used = torch.sort(torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB]).values
    tensors["d2t"] = used - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, used, True)
    config = _draft_config(
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=DRAFT_VOCAB,
        eagle_aux_hidden_state_layer_ids=aux_layer_ids,
    )
    return _save_draft(path, tensors, config)


def make_eagle_draft(path: Path) -> Path:
    """A tiny EAGLE-1 draft named like yuhuili/EAGLE-LLaMA3-Instruct-8B."""
    gen = torch.Generator().manual_seed(2)
    tensors = _draft_layer(gen, "layers.0", HIDDEN)
    tensors["embed_tokens.weight"] = _rand(gen, VOCAB, HIDDEN)
    tensors["fc.weight"] = _rand(gen, HIDDEN, 2 * HIDDEN)
    config = _draft_config(architectures=["LlamaForCausalLM"], bias=False)
    return _save_draft(path, tensors, config)


def _save_draft(path: Path, tensors: dict[str, Any], config: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def layer_indices(names: list[str]) -> list[int]:
    return sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def hf_tokens(llama: Path) -> list[list[int]]:
    return vllm_env.transformers_greedy(llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def hf_weights(llama: Path) -> dict[str, Any]:
    return safetensors_torch.load_file(str(llama / "model.safetensors"))


def test_generate_tp1_matches_transformers(llama: Path, hf_tokens: list[list[int]]) -> None:
    assert vllm_env.generate(llama, 1, 1, prompts=PROMPTS, max_tokens=MAX_TOKENS) == hf_tokens


def test_server_tp1_matches_transformers(llama: Path, hf_tokens: list[list[int]]) -> None:
    tokens = vllm_env.serve_and_complete(llama, 1, 1, "auto", PROMPTS[0], max_tokens=MAX_TOKENS)
    assert tokens == hf_tokens[0]


def test_dump_tp2_pp2_follows_default_partition(
    llama: Path, hf_weights: dict[str, Any], tmp_path: Path
) -> None:
    files = vllm_env.dump_state(llama, 2, 2, tmp_path)
    assert set(files) == vllm_env.expected_dumps(tp=2, pp=2, with_draft=False)
    for (role, pp_rank, tp_rank), path in files.items():
        tensors, meta = vllm_env.read_dump(path)
        assert (meta["role"], meta["pp_rank"], meta["tp_rank"]) == (role, pp_rank, tp_rank)
        assert meta["model_class"] == "LlamaForCausalLM"
        names = sorted(tensors)
        assert layer_indices(names) == [[0, 1], [2, 3]][pp_rank]  # get_pp_indices(4, r, 2)
        ends = (
            ["model.embed_tokens.weight"]
            if pp_rank == 0
            else ["lm_head.weight", "model.norm.weight"]
        )
        layers = [f"model.layers.{i}.{p}" for i in layer_indices(names) for p in LAYER_PARAMS]
        assert names == sorted(ends + layers)
        check_rank_values(tensors, hf_weights, pp_rank, tp_rank)


def check_rank_values(
    tensors: dict[str, Any], hf: dict[str, Any], pp_rank: int, tp_rank: int
) -> None:
    """Vocab rows padded to 1024 then split; qkv = [q | k | v] rows of this rank."""
    per = PADDED_VOCAB // 2
    vocab_name = ("model.embed_tokens.weight", "lm_head.weight")[pp_rank]
    padded = torch.zeros(PADDED_VOCAB, HIDDEN)
    padded[:VOCAB] = hf[vocab_name]
    assert torch.equal(tensors[vocab_name], padded[tp_rank * per : (tp_rank + 1) * per])
    layer = 2 * pp_rank
    prefix = f"model.layers.{layer}.self_attn"
    q_rows, kv_rows = HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2
    expected = torch.cat(
        [
            hf[f"{prefix}.{p}_proj.weight"][tp_rank * rows : (tp_rank + 1) * rows]
            for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
        ]
    )
    assert torch.equal(tensors[f"{prefix}.qkv_proj.weight"], expected)
    assert tensors[f"{prefix}.qkv_proj.weight"].is_contiguous()


def test_dump_tied_embeddings_tp1_pp2(tmp_path: Path) -> None:
    model = make_llama(tmp_path / "tied", tie=True)
    files = vllm_env.dump_state(model, 1, 2, tmp_path / "dump")
    last, last_meta = vllm_env.read_dump(files[("target", 1, 0)])
    first, _ = vllm_env.read_dump(files[("target", 0, 0)])
    assert "model.embed_tokens.weight" in first
    # lm_head is the embedding's Parameter: kept once, under the embedding's name.
    assert "lm_head.weight" not in last
    assert last_meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(last["model.embed_tokens.weight"], first["model.embed_tokens.weight"])


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_speculative_tp1_dumps_draft(
    method: str, llama: Path, hf_tokens: list[list[int]], tmp_path: Path
) -> None:
    if method == "eagle3":
        draft = make_eagle3_draft(tmp_path / "draft", aux_layer_ids=[1, 2, 3])
    else:
        draft = make_eagle_draft(tmp_path / "draft")
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 2}
    dump_dir = tmp_path / "dump"
    tokens = vllm_env.generate(
        llama, 1, 1, "dump-default", prompts=PROMPTS, speculative_config=spec, dump_dir=dump_dir
    )
    assert tokens == hf_tokens  # greedy speculative decoding keeps the target's output
    files = vllm_env.dump_files(dump_dir)
    assert set(files) == vllm_env.expected_dumps(tp=1, pp=1, with_draft=True)
    tensors, meta = vllm_env.read_dump(files[("draft", 0, 0)])
    shapes = {name: list(t.shape) for name, t in tensors.items()}
    assert shapes == expected_draft_shapes(method, tp=1)
    if method == "eagle3":
        assert (meta["has_own_lm_head"], meta["has_own_embed_tokens"]) == (True, False)
        d2t = safetensors_torch.load_file(str(draft / "model.safetensors"))["d2t"]
        assert torch.equal(tensors["draft_id_to_target_id"], d2t)
    else:
        assert (meta["has_own_lm_head"], meta["has_own_embed_tokens"]) == (False, True)


def expected_draft_shapes(method: str, tp: int) -> dict[str, list[int]]:
    """vLLM's draft parameters on one TP rank (names: model.layers.0, not 4)."""
    q, kv = HEADS * HEAD_DIM // tp, KV_HEADS * HEAD_DIM // tp
    layer = "model.layers.0"
    shapes = {
        f"{layer}.self_attn.o_proj.weight": [HIDDEN, q],
        f"{layer}.mlp.gate_up_proj.weight": [2 * INTER // tp, HIDDEN],
        f"{layer}.mlp.down_proj.weight": [HIDDEN, INTER // tp],
        f"{layer}.post_attention_layernorm.weight": [HIDDEN],
        "model.embed_tokens.weight": [PADDED_VOCAB // tp, HIDDEN],
    }
    if method == "eagle":
        shapes[f"{layer}.self_attn.qkv_proj.weight"] = [q + 2 * kv, HIDDEN]
        shapes["model.fc.weight"] = [HIDDEN, 2 * HIDDEN]
        return shapes
    shapes[f"{layer}.self_attn.qkv_proj.weight"] = [q + 2 * kv, 2 * HIDDEN]
    shapes[f"{layer}.input_layernorm.weight"] = [HIDDEN]
    shapes[f"{layer}.hidden_norm.weight"] = [HIDDEN]
    shapes["model.fc.weight"] = [HIDDEN, 3 * HIDDEN]
    shapes["model.norm.weight"] = [HIDDEN]
    shapes["lm_head.weight"] = [512 // tp, HIDDEN]
    shapes["draft_id_to_target_id"] = [DRAFT_VOCAB]
    return shapes


def test_eagle3_tp2_pp2_dumps_draft_on_last_stage(tmp_path: Path) -> None:
    """pp > 1 with a draft loads on the CPU, then fails before serving (see docs/vllm-notes.md).

    Six target layers so that the aux layers [4, 5, 6] all live on the last stage.
    """
    target = make_llama(tmp_path / "target", num_layers=6)
    draft = make_eagle3_draft(tmp_path / "draft", aux_layer_ids=[4, 5, 6])
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    files = vllm_env.dump_state(
        target, 2, 2, tmp_path / "dump", speculative_config=spec, allow_engine_failure=True
    )
    assert set(files) == vllm_env.expected_dumps(tp=2, pp=2, with_draft=True)
    for tp_rank in range(2):
        tensors, meta = vllm_env.read_dump(files[("draft", 1, tp_rank)])
        assert meta["model_class"] == "Eagle3LlamaForCausalLM"
        shapes = {name: list(t.shape) for name, t in tensors.items()}
        assert shapes == expected_draft_shapes("eagle3", tp=2)
    last_target, _ = vllm_env.read_dump(files[("target", 1, 0)])
    # spec_decode_needs_target_embed: the last stage also holds the embedding.
    assert "model.embed_tokens.weight" in last_target
    error = tmp_path / "dump" / "engine-error.txt"
    if error.exists():
        assert "drafter" in error.read_text() or "aux_hidden_states" in error.read_text()
