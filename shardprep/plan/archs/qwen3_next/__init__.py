"""Qwen3-Next (`family.py`), its MTP draft (`mtp.py`) and Qwen3.5-MoE (`qwen3_5_moe.py`),
Qwen3-Next's layers under a vision tower."""
