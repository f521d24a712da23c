"""Formats in: what a model is made of on disk, read and checked before anything runs.

config.json and generation_config.json (`config`), safetensors checkpoints and their fingerprints
(`checkpoint`), GGUF import (`gguf_import`, `gguf_tokenizer`), tokenizer.json with its sandboxed
chat template (`tokenizer`), incremental detokenisation and stop strings (`detokenize`), and the
embedded default model (`default_model`). The lowest layer: it imports nothing above it.
"""
