"""DFlash drafter training fed by the dflash-loader daemon (``dflash-train``).

Rooms, in the order data flows through them:

* ``data``: conversations in, a loader corpus out: sources and messages, the chat-template
  encoder and its span finder, ``tokenize``, the corpus format (schema, shard writer,
  held-out prompts), regeneration in process (``regen``) and through a server
  (``server``: spec, HTTP client, journal, run);
* ``model``: the frozen target and its features, the drafter and its block attention, what a
  micro-batch trains on (documents, anchors, labels: ``blocks``), the loss with its fused LM
  head, the verifier (acceptance length tau);
* ``train``: the loop (optimizer, accumulation by the loader's ``micro``, DDP, metrics,
  eval), batch sources, checkpoints (which own their record), cost records, distributed
  set-up, clean stop, ``dflash-torchrun``;
* ``hf``: the remote code shipped with an export, the export itself, ``--init-drafter``;
* ``ops``: tools over a finished run (``calibrate``, ``plot``), torch-free;
* ``cli``: the ``dflash-train`` commands, thin; their flags come from ``options``.

Below them, open to all: ``options`` (every option, typed, one source), ``files`` (atomic
outputs), ``progress``. Above them: ``run``, the composition root that assembles one
rank's training run. The rules are tests (``tests/unit/test_layering.py``).
"""
