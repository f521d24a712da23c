"""The runtime: a model's math and where its weights live while it runs.

The Llama-family forward (`model`), the KV cache (`kv_cache`), weight-only quantised matmuls
(`quant`), the packed on-disk layer store and its O_DIRECT reader (`layer_store`), the placement
plan across device / pinned RAM / disk (`placement`), the pipelined layer executor (`streamer`),
and building a model from a plan (`loader`). Imports only the formats below it.
"""
