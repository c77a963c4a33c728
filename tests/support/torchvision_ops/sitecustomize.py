"""Test-only, on the vLLM python's PYTHONPATH for the runs that need torchvision
(`vllm_env.with_torchvision`): lets torchvision's Python part import beside the CPU torch.

PyPI's torchvision is a CUDA build whose compiled operators cannot load beside the CPU
build of torch, so `scripts/test.sh` keeps the package without them. At import, torchvision
still registers fake kernels for `torchvision::nms` and `torchvision::qnms`, which fails
unless those operators exist: this declares their schemas, with no kernel (calling one
raises). vLLM needs torchvision for Qwen3.5 only through transformers' Qwen2-VL image and
video processors, whose transforms are plain torch; no test calls a torchvision operator.
"""

import torch.library

_TORCHVISION = torch.library.Library("torchvision", "DEF")
for _name in ("nms", "qnms"):
    _TORCHVISION.define(f"{_name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
