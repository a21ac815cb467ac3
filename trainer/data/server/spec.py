"""The options of ``regen --server``: the server, the requests, and how the result is
tokenized (the ``tokenize`` command's own options, embedded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainer.options import Options, TokenizeOptions, opt

SERVER = "Through a server (--server URL --tokenizer DIR; SRC... are conversations)"


@dataclass(frozen=True, kw_only=True)
class ServerRegenSpec(Options):
    url: str = opt(
        help="OpenAI-compatible server (SGLang, vLLM) serving the target, e.g. "
        "http://127.0.0.1:30000: SRC... are then conversations, OUT a corpus folder.",
        flag="--server", section=SERVER,
    )  # fmt: skip
    tokenizer: Path = opt(
        help="The target's tokenizer folder (its chat template tokenizes OUT).",
        path={"exists": True, "file_okay": False}, section=SERVER,
    )  # fmt: skip
    model: str | None = opt(None, "Served model name [the first it lists].", section=SERVER)
    concurrency: int = opt(64, "Conversations (= requests) in flight.", section=SERVER)
    temperature: float = opt(0.0, "0 = greedy.", section=SERVER)
    max_tokens: int = opt(2048, "Tokens per reply.", section=SERVER)
    thinking: bool = opt(
        False, "chat_template_kwargs enable_thinking, at generation and tokenization.",
        flag="--thinking/--no-thinking", section=SERVER,
    )  # fmt: skip
    restart: bool = opt(
        False, "Discard OUT's journal (OUT.regen.jsonl) and regenerate every row, e.g. after "
        "the inputs changed (a rerun refuses changed inputs without it).", section=SERVER,
    )  # fmt: skip
    retries: int = opt(5, "Per request, on connection errors, 408, 429, 5xx.", section=SERVER)
    timeout_s: float = opt(600.0, "Per request.", section=SERVER)
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    tokenize: TokenizeOptions = field(default_factory=TokenizeOptions)

    @property
    def holdout(self) -> int:
        return self.tokenize.holdout

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = {
            "--concurrency": self.concurrency >= 1,
            "--max-tokens": self.max_tokens >= 1,
            "--retries": self.retries >= 0,
            "--timeout-s": self.timeout_s > 0,
            "--temperature": self.temperature >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = {k: getattr(self, k[2:].replace("-", "_")) for k in bad}
            raise ValueError(f"out of range: {values} (need counts >= 1, retries >= 0)")
