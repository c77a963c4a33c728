"""The flags of `shardprep convert` and `plan`, and of `publish` and `fetch`."""

from __future__ import annotations

import argparse

from shardprep.format.dtypes import MODEL_DTYPES
from shardprep.plan import archs


def add_convert_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model folder or Hugging Face repo id")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default: 1)")
    parser.add_argument(
        "--draft", metavar="DRAFT", help="speculative draft: folder or Hugging Face repo id"
    )
    parser.add_argument(
        "--draft-method",
        choices=archs.standalone_methods(),
        help="default: told from the tensors",
    )
    parser.add_argument(
        "--no-mtp",
        action="store_true",
        help="leave out the MTP draft layers a DeepSeek-V3 checkpoint carries (by default "
        "they become the artifact's draft)",
    )
    parser.add_argument(
        "--pp-partition",
        metavar="SIZES",
        help="layers per stage, e.g. 31,30 (default: vLLM's split, or "
        "VLLM_PP_LAYER_PARTITION when set)",
    )
    parser.add_argument("--stage", metavar="P", type=int, help="convert only this pipeline stage")
    parser.add_argument(
        "--max-part-size", default="5GiB", help="largest rank file part (default: 5GiB)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *MODEL_DTYPES],
        help="dtype of the rank files (default: auto, what vLLM's auto picks)",
    )
    parser.add_argument("--revision", metavar="REV", help="revision of a Hub model")
    parser.add_argument(
        "--endpoint", metavar="URL", help="Hub URL of a repo id (default: HF_ENDPOINT)"
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="as vLLM's flag: each rank holds whole experts of its range (MoE models)",
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        help="vLLM's --data-parallel-size, with --enable-expert-parallel: experts spread "
        "over tp x dp ranks (default: 1)",
    )
    parser.add_argument(
        "--expert-placement-strategy",
        choices=["linear", "round_robin"],
        default="linear",
        help="as vLLM's flag; round_robin applies only where vLLM applies it (grouped routing) "
        "(default: linear)",
    )
    parser.add_argument(
        "--mxfp4-pad",
        default=None,
        metavar="PAD",
        help="MXFP4 experts, I or I,H: bake one MoE backend's alignment of the per-rank "
        "intermediate size (and of the hidden size) into the rank files: 32 on CPU, 64 "
        "Triton, 128,128 CUTLASS/DeepGEMM, 128,256 Marlin/TRT-LLM; such an artifact serves "
        "its own tp and the backends that pad as much or more (default: none baked in, the "
        "loader pads for whatever backend vLLM picks, and every served tp)",
    )


def add_hub_flags(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "publish":
        parser.add_argument(
            "artifact", metavar="OUT", help="artifact folder (it must pass `shardprep verify`)"
        )
    parser.add_argument("repo_id", metavar="REPO_ID", help="Hub repo id, e.g. org/Model-TP8-PP2")
    parser.add_argument(
        "--endpoint",
        metavar="URL",
        help="Hub URL (default: HF_ENDPOINT, else https://huggingface.co)",
    )
    if name == "publish":
        parser.add_argument("--private", action="store_true", help="create the repo private")
        parser.add_argument(
            "--revision", metavar="REV", default="main", help="branch to commit to (default: main)"
        )
        parser.add_argument(
            "--compress", choices=["zstd"], help="transport compression of the rank files"
        )
        return
    parser.add_argument(
        "--stage", metavar="P", type=int, help="the pipeline stage this node serves"
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--rank", metavar="R", type=int, help="only this tensor parallel rank of the stage"
    )
    only.add_argument("--all", action="store_true", help="every stage")
    parser.add_argument(
        "--pp",
        metavar="P'",
        type=int,
        help="--stage is a stage of this pipeline size: fetch the artifact stages that hold "
        "its layers (for an artifact that serves any pp)",
    )
    parser.add_argument(
        "--tp",
        metavar="T'",
        type=int,
        help="--rank is a rank of this tensor parallel size (a divisor of the artifact's): "
        "fetch the artifact ranks it is made of",
    )
    parser.add_argument("--revision", metavar="REV", help="branch, tag or commit (default: main)")
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="cache folder (default: SHARDPREP_CACHE, else HF_HOME/shardprep)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-hash the files already in the cache and download again any that fail",
    )
