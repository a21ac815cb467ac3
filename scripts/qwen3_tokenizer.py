"""A real Qwen3 tokenizer folder, built offline from the Qwen BPE ranks a pinned PyPI package
ships: ``python -m scripts.qwen3_tokenizer OUT`` (or ``qwen3_tokenizer_dir()``).

Qwen2 and Qwen3 share one byte-level BPE: 151,643 ranked tokens (``qwen.tiktoken``, which
``dashscope`` carries in ``dashscope/resources/``), the same pre-tokenizer regex, an NFC
normalizer, and Qwen3's 26 added tokens at ids 151643-151668. This module turns the ranks
into a ``tokenizer.json`` (vocabulary and merges), adds those tokens and the public Qwen3-8B
chat template (``qwen3_chat_template.jinja``), and writes a folder ``AutoTokenizer`` and
vLLM load as a Qwen3-8B download's. Like the download it has no ``<|MASK|>`` (z-lab adds it
with ``add_special_tokens``: id 151669, a spare row of the 151,936-row embedding).

The wheel is downloaded once with pip (PyPI is the one network this project's machines
reach) into ``$DFLASH_CACHE`` (default ``~/.cache/dflash-loader``), outside the clone, and
checked against its pinned SHA-256; the built folder is cached next to it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "dashscope==2.0.2"
WHEEL = "dashscope-2.0.2-py3-none-any.whl"
WHEEL_SHA256 = "0602d1800f7433bdb7953560986eaf5146454ed3988636c0a91963ba24e74258"
RANKS_MEMBER = "dashscope/resources/qwen.tiktoken"
RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
#: Qwen2/Qwen3's pre-tokenizer split (tiktoken's ``pat_str`` for these ranks).
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RANKS = 151643
#: Qwen3's added tokens from id 151643 on, and whether each is special.
ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]  # fmt: skip
#: Rows of Qwen3-8B's embedding (and LM head): 267 more than the tokenizer's 151,669 tokens.
QWEN3_8B_VOCAB = 151936
TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")
VERSION = "1"  # of the folder this module writes: bump to rebuild caches


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash-loader")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pinned_wheel(package: str, name: str, digest: str, cache: Path | None = None) -> Path:
    """The wheel ``name`` of ``package`` (``pkg==version``) in the cache, downloaded with pip
    when missing, and refused unless its SHA-256 is ``digest``."""
    root = cache or cache_root()
    wheel = root / name
    if not wheel.is_file() or sha256(wheel) != digest:
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(root)]
        subprocess.run([*cmd, package], check=True)
        if sha256(wheel) != digest:
            raise RuntimeError(f"{wheel}: SHA-256 differs from the pinned {digest}")
    return wheel


def ranks_file(cache: Path | None = None) -> Path:
    """``qwen.tiktoken`` from the pinned wheel (downloaded with pip once, then cached)."""
    root = cache or cache_root()
    out = root / "qwen.tiktoken"
    if out.is_file() and sha256(out) == RANKS_SHA256:
        return out
    wheel = pinned_wheel(PACKAGE, WHEEL, WHEEL_SHA256, root)
    with zipfile.ZipFile(wheel) as z, tempfile.NamedTemporaryFile(dir=root, delete=False) as t:
        t.write(z.read(RANKS_MEMBER))
    if sha256(Path(t.name)) != RANKS_SHA256:
        os.unlink(t.name)
        raise RuntimeError(f"{wheel}: {RANKS_MEMBER} differs from the pinned SHA-256")
    os.replace(t.name, out)
    return out


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{NUM_RANKS - 1}")
    return ranks


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE's alphabet)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The last merge that builds ``token``: BPE over ``token``'s bytes using only ranks
    below its own ends in exactly two parts."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise ValueError(f"rank {limit}: {token!r} is not one merge of two ranked tokens")
    return parts[0], parts[1]


def tokenizer_json(ranks: dict[bytes, int]) -> dict:
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    merges = [
        [text(a), text(b)]
        for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])
        if len(t) > 1
        for a, b in [_split(t, ranks)]
    ]
    added = [
        {"id": NUM_RANKS + i, "content": c, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": s}
        for i, (c, s) in enumerate(ADDED)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_folder(out: Path, ranks: dict[bytes, int]) -> Path:
    """The tokenizer folder, written whole to a temporary sibling, then renamed."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = tokenizer_json(ranks)
        (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        (tmp / "vocab.json").write_text(json.dumps(tok["model"]["vocab"], ensure_ascii=False))
        merges = "\n".join(" ".join(m) for m in tok["model"]["merges"])
        (tmp / "merges.txt").write_text("#version: 0.2\n" + merges + "\n")
        config = {
            "tokenizer_class": "Qwen2Tokenizer",
            "model_max_length": 131072,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {
                str(a["id"]): {k: a[k] for k in a if k != "id"} for a in tok["added_tokens"]
            },
            "additional_special_tokens": [c for c, s in ADDED if s][1:],
            "chat_template": TEMPLATE.read_text(),
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        (tmp / "dflash-qwen3-tokenizer").write_text(VERSION + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def qwen3_tokenizer_dir(cache: Path | None = None) -> Path:
    """The cached Qwen3 tokenizer folder (built on first use: a few seconds)."""
    root = cache or cache_root()
    out = root / "qwen3-tokenizer"
    stamp = out / "dflash-qwen3-tokenizer"
    template_ok = (out / "tokenizer_config.json").is_file() and json.loads(
        (out / "tokenizer_config.json").read_text()
    ).get("chat_template") == TEMPLATE.read_text()
    if stamp.is_file() and stamp.read_text().strip() == VERSION and template_ok:
        return out
    return write_folder(out, load_ranks(ranks_file(root)))


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m scripts.qwen3_tokenizer OUT_DIR  (copies the cached folder)")
    out = Path(sys.argv[1])
    if out.exists():
        sys.exit(f"{out}: exists; choose a new folder")
    shutil.copytree(qwen3_tokenizer_dir(), out)
    print(out)


if __name__ == "__main__":
    main()
