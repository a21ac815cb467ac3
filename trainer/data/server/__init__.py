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
``OUT.regen.jsonl`` and flushed. Its first line holds the settings and the fingerprint of
every input file (size, mtime, BLAKE2b of the content). A restarted run reads it (a torn
last line, from a kill mid-write, is cut off; any other line of the wrong shape is an error
naming the journal and the line), skips the finished rows and retries the failed ones. A
journal written with other settings (sources, model, temperature, max tokens, thinking) is
refused, and so is one whose inputs changed since (another size or content: one line names
the file; a new mtime alone is fine) or that records no fingerprints (an older version
wrote it: whether its rows are this input's is unknown); ``--restart`` discards the
journal and regenerates every row. The server's URL, the concurrency and the tokenization
options may change. An input that changes while the run reads it stops the run before it
tokenizes. SIGTERM, SIGHUP and Ctrl-C drop the requests in flight at once and leave the
journal resumable.

When every row is done, the finished conversations are tokenized in source order
(``trainer.data.tokenize.tokenize_corpus``: the same template and mask rules as ``dflash-train
tokenize``), so OUT does not depend on completion order. The last ``holdout`` valid rows
are not regenerated: their prompts are written for the verifier. Rows that failed
(malformed, refused by the server, out of retries) are counted by reason in the summary and
in ``OUT/tokenize_report.json`` (``regen_failed``, ``regen_first_failed``); the command
then exits 3 after printing the summary, and a run where no row could be regenerated is an
error naming the reasons (HTTP statuses).

Modules: ``spec`` (the options), ``http`` (the chat-completions client), ``journal``
(finished rows, resumable), ``run`` (the run itself).
"""
