"""The on-disk contract that the converter, the Hub side and the loader share: manifest
records and their strict reading, the recorded conversion request, the vLLM layout
contract, the strict safetensors header parser and JSON helpers. No family knowledge;
imports nothing of shardprep but the ground floor."""
