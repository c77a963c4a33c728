"""DeepSeek-V4 (`family.py`), its built-in DSpark draft (`dspark.py`) and the variants of
the declared quantization schemes that vLLM applies to it (`quant.py`)."""
