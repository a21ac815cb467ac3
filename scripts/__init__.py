"""Dev tooling, not installed: the demo (``demo.py``) and venv setup at the top; rooms below
it, each importing only the rooms under it (``tests/unit/test_layering.py``):

* ``fixtures/``: what tests, checks and benchmarks build on the spot (the real Qwen3
  tokenizer, real and tiny chats, a random-weight Qwen3 checkpoint); no other room;
* ``servers/``: processes that serve, started and stopped from Python (the loader daemon,
  the OpenAI-compatible stand-in, vLLM's OpenAI server and the calls to it); may use
  fixtures;
* ``checks/``: serve-check, the GPU check, the systemd check and the load measurement they
  share with the benchmarks; may use servers and fixtures.

Nothing here imports ``benchmarks/`` (which may import this package).
"""
