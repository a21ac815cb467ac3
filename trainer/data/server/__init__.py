"""``dflash-train regen SRC... OUT --server URL``: regenerate a conversation dataset's
assistant replies through an OpenAI-compatible chat-completions server (SGLang, vLLM), then
tokenize the result into a loader corpus.

Per conversation (``trainer.data.messages.to_messages``: ShareGPT or OpenAI rows), every assistant
turn is regenerated in order: the server gets the history (system and user turns plus the
replies already regenerated) and its reply replaces the original. A conversation that ends
in a user turn gets a reply for it (a prompt-only row becomes a one-turn conversation;
counted as ``answered_trailing_user``). A row with no user turn, or with an assistant turn
before the first user turn, fails (``no_user_turn``, ``assistant_before_user``).

Requests: stdlib HTTP (one keep-alive connection per worker thread), at most
``concurrency`` conversations (so requests) in flight. Connection errors, 408, 429 and 5xx
are retried ``retries`` times with exponential backoff and jitter, never sooner than a
``Retry-After`` asks; any other 4xx fails the row with its reason (``http_400`` ...).
A row whose retries run out on an HTTP status fails with it; a server that stops answering
altogether ends the run with an error (the journal keeps what finished: run it again).

Journal: each finished conversation (or failed row) is appended as one JSON line to
``OUT.regen.jsonl`` and flushed. A restarted run reads it (a torn last line, from a kill
mid-write, is cut off), skips the finished rows and retries the failed ones; a journal
written with other settings (sources, model, temperature, max tokens, thinking) is
refused; the server's URL, the concurrency and the tokenization options may change.
When every row is done, the finished conversations are tokenized in source order
(``trainer.data.tokenize.tokenize_corpus``: the same template and mask rules as ``dflash-train
tokenize``), so OUT does not depend on completion order. The last ``holdout`` valid rows
are not regenerated: their prompts are written for the verifier.

Modules: ``spec`` (the options), ``http`` (the chat-completions client), ``journal``
(finished rows, resumable), ``run`` (the run itself).
"""
