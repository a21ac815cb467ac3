"""Conversations in, a loader corpus out: ``sources`` (files and folders of rows),
``messages`` (a row as messages), ``encoder`` (chat template, loss mask: ``ChatEncoder``
over ``template``, ``spans``, ``token_spans`` and ``tokenizer``), ``tokenize``
(``dflash-train tokenize``), ``corpus`` (schema, writers, held-out prompts), ``regen``
(responses rewritten by the target in process) and ``server`` (``regen --server``).
Everything but ``regen`` works without torch."""
