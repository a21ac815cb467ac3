"""dflash-loader daemon side, in four rooms that follow the data flow:

* ``wire``: what crosses the process boundary (messages, the ring's layout, the counters
  extension); the only part clients import;
* ``data``: the memory-mapped Arrow corpus, its shards and change watch, the native row
  gather, synthetic corpora, corpus summaries;
* ``planning``: pure functions from lengths and a batch spec to an epoch plan, the cost
  model, and the plan-quality measures;
* ``service``: the daemon (config, sockets, sessions, production, plan cache, rings,
  read-ahead, systemd and Prometheus plumbing);

and ``cli``, the ``dflash-loader`` command. Each room imports only the rooms listed above
it (``tests/unit/test_layering.py`` holds the rules). Public to the trainer:
``loader_server.wire``, ``loader_server.planning.cost`` (the cost model its calibration
fits) and ``loader_server.data.dataset.open_dataset`` (reading a corpus).
"""
