"""What families lend each other: MLA and its decoder layer (`mla.py`), the dense attention
and MLP of the Llama lineage (`dense.py`), routed and shared experts (`moe.py`), the
EAGLE-style draft skeleton (`eagle.py`), the MTP skeleton (`mtp.py`), the MoonViT vision
tower (`moonvit.py`), the names most checkpoints share (`names.py`) and the application of
a quantization scheme to any family's tensors (`quantized.py`). A part imports `base` and
other parts, never a family.
"""
