"""Processes that serve, started and stopped from Python: the loader daemon
(``daemon_process``), the OpenAI-compatible stand-in (``chat_server``), vLLM's OpenAI server
and the calls made to it (``vllm_client``). May use ``scripts.fixtures``, nothing else of
``scripts/``."""
