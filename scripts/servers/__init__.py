"""Processes that serve, started and stopped from Python: the loader daemon
(``daemon_process``) and the OpenAI-compatible stand-in (``chat_server``); vLLM's OpenAI
server and the calls made to it are ``trainer.eval.engine`` (installed: the evaluation uses
it too). May use ``scripts.fixtures``, nothing else of ``scripts/``."""
