"""The DeepSeek-V3 lineage: DeepSeek-V2 and V3 (`v3.py`), their MTP draft (`mtp.py`),
DeepSeek-V3.2 with its indexer (`v32.py`), and Kimi-K2.5 (`kimi_k25.py`), V3's text model
under a MoonViT tower."""
