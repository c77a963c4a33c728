"""Two nodes as the seed runs them, at tiny size: vLLM's own multi-node executor
(`vllm serve REPO --nnodes 2 --node-rank 0|1 --master-addr --master-port`, `--headless` on
node 1), started on a Hub repo id with `--load-format sharded-fast`. Each node is a process
tree of its own, with its own Hugging Face home, shardprep cache, TMPDIR and Hub endpoint
(two test Hubs over the same repos, each counting what its node downloads).

A DeepSeek-V3 (MLA, routed experts) with its MTP draft, converted at tp1 x pp2 in float32
and published: one worker per node, each node one pipeline stage. Two runs of the pair:

- without the draft, serving: node 0's server gives the greedy tokens of the single-node
  default loader;
- with the draft, loading (the CPU build runs no draft at pp > 1): every rank, target and
  draft, holds the single-node default loader's state, each loaded with every collective
  trapped;

and across both, each node downloaded exactly its stage's rank files, once, the draft's
only on the last node (they are part of its stage). A second test runs the README's recipe
for a draft that is a model of its own (DSpark there, EAGLE3 here: its folder from
`shardprep fetch --stage`), a third checks that each node's command is the README's but for
the harness's flags.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_env
from hub_server import HubServer
from test_vllm_layout import assert_same_state, rank_tensors
from test_vllm_moe import TRAP, assert_same_dumps
from vllm_nodes import CLI_MAIN, Node, engine_flags, load_two_nodes, node_command, serve_two_nodes

from shardprep.convert.run import Options, convert
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.format.manifest import read_manifest
from shardprep.hub.cache import repo_folder
from shardprep.hub.publish import publish

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.usefixtures("hf_client_env"),
    pytest.mark.skipif(vllm_env.vllm_python() is None, reason="needs the vLLM environment"),
    pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning"),
]

REPO = "shardprep-test/TinyDeepSeekV3-MTP-TP1-PP2"
EAGLE3_REPO = "shardprep-test/TinyLlama-EAGLE3-TP1-PP2"
# One prompt: the server answers requests one by one, and a batch of two prompts moves
# near-ties of this random model (seen: the second prompt's fifth token), so the offline
# reference must run it alone too.
PROMPTS = [[9, 10, 11]]
LAYERS = 3  # layers 0-1 on node 0, layer 2 on node 1; the MTP layer is model.layers.3
CPU_MLA = {"attention_config": {"backend": "CPU_MLA"}}  # float32 MLA (see test_vllm_mtp.py)
MTP = {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}
LOAD_FORMAT = "dump-sharded-fast"  # sharded-fast, then each rank's state dumped
RANK_FOLDERS = ("shards/", "draft/shards/")
README = Path(__file__).resolve().parents[2] / "README.md"
ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
# What the harness adds for the CPU build and a tiny model (vllm_runner.engine_kwargs), and
# node 0's server address; the rest of each node's command is the README's.
HARNESS_FLAGS = {
    "--dtype", "--skip-tokenizer-init", "--max-model-len", "--seed", "--kv-cache-memory-bytes",
    "--compilation-config", "--attention-config", "--host", "--port",
}  # fmt: skip


def rank_downloads(hub: HubServer, repo: str = REPO) -> dict[str | None, list[str]]:
    """The rank files this Hub served, once per download, by the worker that asked for them
    (the dump loader labels its requests `target-pp{P}-tp{T}`)."""
    found = {
        origin: sorted(p for p in paths if p.startswith(RANK_FOLDERS))
        for origin, paths in hub.downloads_by_origin(repo).items()
    }
    return {origin: paths for origin, paths in found.items() if paths}


def cached_rank_files(node: Node, repo: str = REPO) -> dict[str, bytes]:
    (commit,) = [p for p in repo_folder(repo, cache_dir=node.cache).iterdir() if len(p.name) == 40]
    files = [p for folder in RANK_FOLDERS for p in (commit / folder).glob("*.safetensors")]
    return {str(p.relative_to(commit)): p.read_bytes() for p in files}


def run_both(nodes: tuple[Node, Node]) -> tuple[list[list[int]], list[vllm_env.DumpFiles]]:
    """The two runs of the pair: serving without the draft (its tokens, and what each node
    loaded, moved aside), then loading with it; (tokens, [served dumps, loaded dumps])."""
    tokens = serve_two_nodes(REPO, nodes, 1, 2, LOAD_FORMAT, PROMPTS, env=TRAP, engine=CPU_MLA)
    served = moved_dumps(nodes, "served")
    expected = vllm_env.expected_dumps(1, 2, with_draft=True)
    load_two_nodes(
        lambda: expected <= dumped(nodes).keys(), REPO, nodes, 1, 2, LOAD_FORMAT,
        env=TRAP, engine=CPU_MLA, speculative_config=MTP,
    )  # fmt: skip
    return tokens, [served, dumped(nodes)]


def dumped(nodes: tuple[Node, ...]) -> vllm_env.DumpFiles:
    return {key: path for node in nodes for key, path in vllm_env.dump_files(node.dumps).items()}


def moved_dumps(nodes: tuple[Node, Node], name: str) -> vllm_env.DumpFiles:
    """Each node's dumps, checked to be its own stage's, moved to `name` beside them."""
    assert sorted(vllm_env.dump_files(nodes[0].dumps)) == [("target", 0, 0)]
    assert sorted(vllm_env.dump_files(nodes[1].dumps)) == [("target", 1, 0)]
    moved = {}
    for node in nodes:
        for key, path in vllm_env.dump_files(node.dumps).items():
            moved[key] = path.rename(node.root / f"{name}-{path.name}")
    return moved


def test_two_nodes_serve_a_hub_repo_each_fetching_only_its_stage(tmp_path: Path) -> None:
    vllm_env.require_dump_plugin()
    model = make_tiny_model(
        tmp_path / "model", "DeepseekV3ForCausalLM",
        num_hidden_layers=LAYERS, num_nextn_predict_layers=1,
    )  # fmt: skip
    artifact = tmp_path / "artifact"
    convert(str(model), artifact, Options(tp=1, pp=2, dtype="float32"), progress=False)
    manifest = read_manifest(artifact)
    store = tmp_path / "hub-storage"
    with HubServer(store) as hub0, HubServer(store) as hub1:
        publish(artifact, REPO, endpoint=hub0.endpoint, progress=False)
        nodes = (Node(tmp_path / "node0", hub0.endpoint), Node(tmp_path / "node1", hub1.endpoint))
        tokens, (served, loaded) = run_both(nodes)
        downloads = [rank_downloads(hub0), rank_downloads(hub1)]

    draft_files = {f.path for f in manifest.files if f.role == "draft"}
    assert draft_files and all(f.pp == 1 for f in manifest.files if f.role == "draft")
    for stage, node in enumerate(nodes):  # the draft's files are part of the last stage
        own = sorted(f.path for f in manifest.files if f.pp == stage)
        assert downloads[stage] == {f"target-pp{stage}-tp0": own}, stage
        cached = cached_rank_files(node)
        assert sorted(cached) == own
        assert all(data == (artifact / path).read_bytes() for path, data in cached.items())
    assert sorted(vllm_env.dump_files(nodes[0].dumps)) == [("target", 0, 0)]
    assert sorted(vllm_env.dump_files(nodes[1].dumps)) == [("draft", 1, 0), ("target", 1, 0)]

    reference = vllm_env.generate(model, 1, 2, "auto", prompts=PROMPTS, engine=CPU_MLA)
    assert [len(seq) for seq in tokens] == [8]
    assert tokens == reference
    default = vllm_env.dump_state(
        model, 1, 2, tmp_path / "default", engine=CPU_MLA, speculative_config=MTP,
        allow_engine_failure=True,
    )  # fmt: skip
    # vLLM's proposer gives the draft the target's head after loading: no rank file has it.
    shared = set(manifest.model("draft").shared_with_target)
    assert_same_dumps(loaded, default, leave_out={("draft", 1, 0): shared})
    assert_same_dumps(served, {k: v for k, v in default.items() if k[0] == "target"})


def fetched(node: Node, repo: str, stage: int) -> Path:
    """`shardprep fetch REPO --stage N --quiet` run as the README runs it, on `node`."""
    cmd = [sys.executable, "-m", "shardprep.cli", "fetch", repo, "--stage", str(stage), "--quiet"]
    env = {**os.environ, **node.env()}
    return Path(
        subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip()
    )


def test_a_draft_of_its_own_from_the_folder_each_node_fetched(tmp_path: Path) -> None:
    """The README's recipe for a draft that is a model of its own (Kimi-K3's DSpark there,
    an EAGLE3 draft of a Llama here): each node runs `shardprep fetch --stage N`, then
    vLLM on the repo id with the draft's folder in what that printed. One run, loading
    only (no draft runs at pp > 1 on the CPU build): every rank, target and draft, holds
    its rank files (what vLLM's default loader leaves, as test_vllm_layout.py proves for
    a Llama and its EAGLE3 draft), loaded with every collective trapped; each node
    downloaded its stage, all by the fetch: the workers found it in the node's cache."""
    vllm_env.require_dump_plugin()
    model = make_tiny_model(tmp_path / "model")
    draft = make_tiny_draft(tmp_path / "draft", model, "eagle3")
    artifact = tmp_path / "artifact"
    options = Options(tp=1, pp=2, dtype="float32", draft=str(draft))
    convert(str(model), artifact, options, progress=False)
    manifest = read_manifest(artifact)
    store = tmp_path / "hub-storage"
    with HubServer(store) as hub0, HubServer(store) as hub1:
        publish(artifact, EAGLE3_REPO, endpoint=hub0.endpoint, progress=False)
        nodes = (Node(tmp_path / "node0", hub0.endpoint), Node(tmp_path / "node1", hub1.endpoint))
        specs = [
            {"method": "eagle3", "model": str(fetched(node, EAGLE3_REPO, stage) / "draft"),
             "num_speculative_tokens": 2}
            for stage, node in enumerate(nodes)
        ]  # fmt: skip
        expected = vllm_env.expected_dumps(1, 2, with_draft=True)
        load_two_nodes(
            lambda: expected <= dumped(nodes).keys(), EAGLE3_REPO, nodes, 1, 2, LOAD_FORMAT,
            env=TRAP, per_node=({"speculative_config": specs[0]}, {"speculative_config": specs[1]}),
        )  # fmt: skip
        downloads = [rank_downloads(hub0, EAGLE3_REPO), rank_downloads(hub1, EAGLE3_REPO)]

    for stage, node in enumerate(nodes):  # unlabelled: the fetch's, not a worker's
        own = sorted(f.path for f in manifest.files if f.pp == stage)
        assert downloads[stage] == {None: own}, stage
        assert sorted(cached_rank_files(node, EAGLE3_REPO)) == own
    assert sorted(vllm_env.dump_files(nodes[0].dumps)) == [("target", 0, 0)]
    assert sorted(vllm_env.dump_files(nodes[1].dumps)) == [("draft", 1, 0), ("target", 1, 0)]
    shared = set(manifest.model("draft").shared_with_target)
    for (role, p, t), path in dumped(nodes).items():
        state, meta = vllm_env.read_dump(path)
        assert meta["trap_armed"] and meta["collective_calls"] == [], meta
        ours = rank_tensors(artifact, role, p, t)
        # What the files leave out of those vLLM then takes from the target stays unfilled.
        left_out = shared - set(ours) if role == "draft" else set()
        assert_same_state({n: v for n, v in state.items() if n not in left_out}, ours)


def readme_nodes() -> list[list[str]]:
    """The README's two-node `vllm serve` commands (node 0, node 1), as argument lists."""
    section = README.read_text().split("### Two nodes, one stage each", 1)[1]
    section = re.split(r"\n#{1,6} ", section, maxsplit=1)[0]
    joined = re.sub(r"\\\n\s*", " ", section)
    return [shlex.split(line) for line in re.findall(r"^ {4}(vllm serve .*)$", joined, re.M)]


def flag_names(args: list[str]) -> list[str]:
    return [ALIASES.get(a, a) for a in args if a.startswith("-")]


def test_the_readme_recipe_is_the_one_the_test_runs() -> None:
    readme = readme_nodes()
    assert [flag_names(cmd).count("--headless") for cmd in readme] == [0, 1]
    flags = engine_flags(REPO, 1, 2, LOAD_FORMAT, engine=CPU_MLA, speculative_config=MTP)
    for rank, cmd in enumerate(readme):
        ours = node_command(REPO, rank, 29501, 8000 if rank == 0 else None, flags)
        assert ours[1:3] == ["-c", CLI_MAIN]  # vLLM's CLI, run from Python
        ours = ["vllm", *ours[3:]]
        assert ours[:3] == ["vllm", "serve", REPO]
        assert sorted(set(flag_names(ours)) - HARNESS_FLAGS) == sorted(flag_names(cmd)), rank
        for flag in ("--nnodes", "--node-rank"):
            assert ours[ours.index(flag) + 1] == cmd[cmd.index(flag) + 1], (rank, flag)
        load_format = cmd[cmd.index("--load-format") + 1]
        assert ours[ours.index("--load-format") + 1] == "dump-" + load_format
