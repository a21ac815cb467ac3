"""The target served by an inference engine: a vLLM server computes the target's hidden
states, the trainer keeps only the target's embedding, final norm and LM head
(``train --target-engine vllm``; docs/TRAINER.md, "Targets served by vLLM").

* ``states``: vLLM's layer ids for ours, and a batch's features assembled from each
  document's states (pure);
* ``client``: one document per request to the server, the file it writes read, checked and
  removed; a server that stops answering waited for and retried, then a clear error;
* ``feed``: the loader's micro-batches read ahead of the plan, their documents' states
  requested before the step needs them, the loader's position kept as consumed (exactly
  once);
* ``target``: ``EngineTarget``, the head of the target, whose features come from the feed;
* ``server``: the server's flags, and the server the trainer starts and owns;
* ``vllm_plugin``: the connector that writes the states, loaded by vLLM's own interpreter.
"""
