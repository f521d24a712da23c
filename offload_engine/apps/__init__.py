"""Applications on top of the engine: the command line (`cli`), the OpenAI-compatible server
(`server`) and distillation of a draft (`distill`). The top layer: nothing in the package imports
it, and only it may import `benchmarks`.
"""
