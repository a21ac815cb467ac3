"""The models and the math of one micro-batch: ``target`` (frozen, its chosen-layer
features), ``drafter`` and ``attention`` (the block rule), ``docs`` (every document of a
batch), ``blocks`` (anchors, labels, weights), ``loss`` (the weighted block cross-entropy
with its fused LM head), ``verifier`` (speculative decoding, tau). No process state: the
training loop owns the optimizer, the allocator policy and the process group."""
