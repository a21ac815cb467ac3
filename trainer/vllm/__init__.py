"""The one home of everything that starts and talks to vLLM: evaluation
(``trainer.eval.engine``), the engine room's vLLM adapter (``trainer.engine.vllm``),
serve-check and the benchmarks all use it. Standard library only (vLLM never runs in the
project's process, and never in its ``.venv``: ``bash scripts/checks/serve_check.sh
--venv-only`` makes vLLM's CPU virtualenv once, in ``${DFLASH_CACHE:-~/.cache/dflash-loader}``).

* ``process``: the OpenAI server as a process (start, wait, stop, why it died);
* ``api``: requests (JSON, token-id completions, seeds);
* ``metrics``: the spec-decode counters off ``/metrics``;
* ``configs``: the speculative and KV-transfer configurations we pass;
* ``connector/``: our hidden-states connector, loaded by vLLM's own interpreter.
"""
