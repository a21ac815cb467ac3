"""The target served by an inference engine (``train --target-engine vllm``; docs/TRAINER.md,
"Targets served by vLLM"): the engine computes the target's hidden states, the trainer
keeps only the target's embedding, final norm and LM head. A generic part, and adapters
behind one seam (``seam``):

* generic: ``feed`` (the loader's micro-batches read ahead of the plan, their documents'
  states requested before the step needs them, the loader's position kept as consumed:
  exactly once), ``client`` (a request per document: bounded waits, checked states),
  ``states`` (a batch's features assembled from its documents' states), ``target``
  (``EngineTarget``, the head of the target), ``supply`` (the run's engine side: the
  server it owns, the run's identity, the adapters chosen by name), ``folders`` (what is
  trusted on disk), ``http`` (one exchange, and what its failure means), ``errors``;
* which engine computes the states: ``vllm`` (its server, layer numbering and requests;
  its process and connector live in ``trainer.vllm``);
* how they travel: ``shm`` (each rank's arena in shared memory, on one machine), ``files``
  (a file per document), ``mooncake`` (a Mooncake store, across machines).
"""
