"""Quantization schemes: how a logical weight becomes its stored tensors (weights, scales)
and how vLLM checks and cuts each of them. Families use a scheme; none holds its rules."""
