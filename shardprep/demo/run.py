"""`shardprep demo`: a tiny Llama with an EAGLE3 draft, converted at tp2 x pp2."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from shardprep import report
from shardprep.convert.run import Options, convert
from shardprep.convert.verify import verify
from shardprep.demo.tiny import make_tiny_draft, make_tiny_model
from shardprep.plan import archs


def run_demo(keep: bool = False) -> tuple[dict[str, Any], str]:
    """Build, convert and fully verify; (data, text). The temporary folder is deleted
    unless `keep`, and the text names it only when it still exists."""
    root = Path(tempfile.mkdtemp(prefix="shardprep-demo-"))
    try:
        model = make_tiny_model(root / "model", vocab_size=1000, num_hidden_layers=5)
        draft = make_tiny_draft(root / "eagle3", model, method="eagle3")
        out = root / "model-tp2-pp2"
        manifest = convert(str(model), out, Options(tp=2, pp=2, draft=str(draft)), progress=False)
        result = verify(out, full=True)
        result.raise_if_failed(out)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = report.artifact_summary(manifest)
    if not keep:  # name no path that no longer exists
        for model_summary in summary["models"]:
            source = Path(str(model_summary["source"]))
            if source.is_relative_to(root):
                model_summary["source"] = str(source.relative_to(root))
    architectures, drafts = archs.supported()
    data = {
        **summary,
        "supported": {"architectures": list(architectures), "drafts": list(drafts)},
        "artifact": str(out) if keep else None,
        "verified": {
            "files": result.checked_files,
            "params": result.checked_params,
            "round_trip_tensors": result.round_trip_tensors,
        },
    }
    where = (
        f"kept in {out} (model, draft and artifact)"
        if keep
        else "written to a temporary folder, now deleted (--keep keeps it)"
    )
    lines = [
        f"tiny Llama (5 layers, vocab 1000) + EAGLE3 draft, converted at tp2 x pp2: {where}",
        report.describe_models(summary),
        report.table(report.manifest_rows(manifest)),
        f"verified: {result.checked_files} files hashed, {result.checked_params} rank "
        f"parameters present exactly once, {result.round_trip_tensors} source tensors "
        "rebuilt byte for byte",
        f"supported: {', '.join(architectures)} (Kimi-K2 is a DeepseekV3ForCausalLM); "
        f"drafts: {', '.join(drafts)}",
    ]
    return data, "\n".join(lines)
