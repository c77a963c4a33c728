"""Whether a rank reads with GPUDirect Storage (GDS): storage to GPU memory, no bounce.

fastsafetensors opens GDS with `cuFileDriverOpen`, which sets up its DMA for every GPU
the process can see and so creates a CUDA context on each of them. vLLM's workers all
see every GPU of the node, so with more than one worker process every worker would
take memory on every GPU; like vLLM's own `fastsafetensors` format, GDS is then off
unless asked for (`--model-loader-extra-config '{"gds": true}'`).
"""

from __future__ import annotations

import glob
from dataclasses import dataclass

GDS_DEVICES = "/dev/nvidia-fs*"
ASK_FOR_IT = "--model-loader-extra-config '{\"gds\": true}'"


@dataclass(frozen=True)
class GdsChoice:
    """Whether to use GDS, and why (the reason is logged with the path taken)."""

    use: bool
    why: str


@dataclass(frozen=True)
class GdsRequest:
    """What the user asked for (`asked`: True, False or None for the default) and how
    many worker processes load at once (vLLM's tp x pp x dp)."""

    asked: bool | None = None
    processes: int = 1

    def decide(self, device: str, *, driver_loaded: bool | None = None) -> GdsChoice:
        """GDS only on a CUDA device, with the nvidia-fs driver loaded, where it was asked
        for or one process loads; `driver_loaded` None looks for the driver's devices."""
        if not device.startswith("cuda"):
            return GdsChoice(False, f"no GDS: device {device}, GDS needs a CUDA device")
        if self.asked is False:
            return GdsChoice(False, "no GDS: gds false was asked for")
        if driver_loaded is None:
            driver_loaded = bool(glob.glob(GDS_DEVICES))
        if not driver_loaded:
            asked = " (asked for, but not possible)" if self.asked else ""
            return GdsChoice(False, f"no GDS{asked}: no {GDS_DEVICES} on this machine")
        if self.processes > 1 and not self.asked:
            return GdsChoice(
                False,
                f"no GDS: {self.processes} worker processes, and GDS would open every "
                f"visible GPU in each; ask for it with {ASK_FOR_IT}",
            )
        return GdsChoice(True, "GDS")
