"""DFlash drafter training fed by the dflash-loader daemon.

Modules, in the order data flows through them:

* ``target``: the frozen Hugging Face causal LM (``tiny``: a seeded random Qwen3) and its
  chosen-layer features;
* ``batches``: the batch shape the trainer consumes, per-document views, an in-process source;
* ``drafter``: the DFlash drafter and its block attention mask;
* ``loss``: anchor sampling and the position-weighted block cross-entropy;
* ``loop``: optimizer, gradient accumulation by the loader's ``micro``, DDP, metrics, resume;
* ``checkpoint``: atomic per-rank checkpoints carrying the loader position;
* ``verifier``: speculative decoding with the target, acceptance length tau;
* ``regen``: rewrite a corpus's responses with the target's greedy output;
* ``metrics`` / ``plot``: JSONL per step and PNG curves;
* ``run`` / ``cli`` / ``distributed``: the ``dflash-train`` command under torchrun.
"""
