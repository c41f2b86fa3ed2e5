"""The model config and tokenizer a GGUF file holds, converted by transformers once and cached as a plain folder.

transformers reads them by parsing every metadata field of the file (for Qwen2.5, 151,936 tokens and 151,387
merges, one numpy slice each): 13 s for the config and 18 s for the tokenizer on a 2-core VM, paid again by every
worker and coordinator start, and twice within one (the gguf engine's loader reads the config, load_tokenizer both).
The cache folder holds what transformers made of the file (config.json, tokenizer.json and their companions),
saved by transformers itself, so loading it gives the same objects in well under a second.

A folder is keyed by the file's absolute path, size and modification time: a replaced file gets a new folder. It
is written to a temporary name and renamed into place, so concurrent first starts of several workers never see a
half-written folder (the loser of the race discards its copy).
"""

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from specdec.common.model_files import cache_dir

log = logging.getLogger("specdec")

COMPLETE = "converted"  # written last: a folder without it is never read


def cache_key(path: str) -> str:
    stat = os.stat(path)
    text = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def converted_folder(path: str) -> Path:
    """The folder with the config and tokenizer of the GGUF file at path, converting them on first use."""
    folder = cache_dir() / "gguf-metadata" / cache_key(path)
    if (folder / COMPLETE).is_file():
        return folder
    from transformers import AutoConfig, AutoTokenizer

    started = time.monotonic()
    source, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    config = AutoConfig.from_pretrained(source, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE).write_text(os.path.abspath(path))
        try:
            os.rename(staging, folder)
        except OSError:  # another process renamed its copy first: use that one
            if not (folder / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("converted the config and tokenizer of %s in %.1f s (cached in %s)", path, time.monotonic() - started, folder)
    return folder


if __name__ == "__main__":  # ahead of time, for the given model specs (the Makefile does the shipped ones)
    import sys

    from specdec.common.model_specs import gguf_path

    logging.basicConfig(level=logging.INFO)
    for spec in sys.argv[1:]:
        converted_folder(gguf_path(spec))
