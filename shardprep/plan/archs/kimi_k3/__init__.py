"""Kimi-K3 (`family.py`): its text model (`text.py`), its MoonViT-3D vision tower
(`vision.py`), its MTP draft (`mtp.py`), its DSpark draft (`dspark.py`) and the variant of
MXFP4 that vLLM applies to its experts (`quant.py`)."""
