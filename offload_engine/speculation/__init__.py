"""Speculation: drafts propose trees, the target verifies them, the caches commit.

The decoding loop and its tree kinds (`decoder`: SpeculativeDecoder, TreeSpec, PrefixCache),
what `--draft` names (`drafts`: self-drafts, the committed default draft), measured acceptance
vectors found by fingerprints (`acceptance_store`) and their measurement (`measure`). The
algorithms themselves are in `sequoia_trees`. Imports the runtime and the formats below it.
"""
