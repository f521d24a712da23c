"""Planning: what this machine can do, and the tree chosen for it.

Hardware profiles and presets (`hw_profile`), the profiler that measures a machine
(`profiler`), `--tree auto`'s glue from a profile and vectors to the optimizer's choice
(`auto_tree`), and the simulator for machines one does not have (`simulator`). Imports
speculation, the runtime and the formats below it.
"""
