"""Tiny models of every family, made on the fly, and the `shardprep demo` command."""
