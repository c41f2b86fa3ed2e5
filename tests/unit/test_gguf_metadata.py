"""The config and tokenizer of a GGUF file, converted once and read from the cache afterwards: the same objects
transformers reads from the file, without parsing it again."""

import os
import shutil

import pytest
import transformers

from specdec.common.gguf_metadata import cache_key, converted_folder
from specdec.common.model_specs import hf_source
from specdec.common.models import load_tokenizer
from specdec.common.tokenizer import HFTokenizer

SMOLLM2 = "smollm2-135m"
TEXTS = ["def f(x):\n    return x**2  # ünïcode 你好", "  leading spaces\t\ttabs\n\n", "<|im_end|>hello<|im_start|>"]


@pytest.mark.slow
def test_the_cached_config_and_tokenizer_are_what_transformers_reads_from_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    folder, kwargs = hf_source(SMOLLM2)
    from_file = transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
    config_from_file = transformers.AutoConfig.from_pretrained(folder, **kwargs)
    converted = converted_folder(os.path.join(folder, kwargs["gguf_file"]))
    assert converted.is_relative_to(tmp_path)
    cached = transformers.AutoTokenizer.from_pretrained(converted)
    assert cached.get_vocab() == from_file.get_vocab()
    assert [cached.encode(t) for t in TEXTS] == [from_file.encode(t) for t in TEXTS]
    messages = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages, tokenize=False) == from_file.apply_chat_template(messages, tokenize=False)
    assert (cached.eos_token, cached.bos_token) == (from_file.eos_token, from_file.bos_token)
    config = transformers.AutoConfig.from_pretrained(converted)
    for field in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "eos_token_id", "max_position_embeddings"):
        assert getattr(config, field) == getattr(config_from_file, field), field

    # Later loads read the folder: transformers is never asked to parse the file again.
    def refuse_gguf(original):
        def load(*args, **kw):
            assert "gguf_file" not in kw, "the GGUF file was parsed again"
            return original(*args, **kw)

        return load

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse_gguf(transformers.AutoTokenizer.from_pretrained))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse_gguf(transformers.AutoConfig.from_pretrained))
    tokenizer = load_tokenizer(SMOLLM2)
    assert tokenizer.fingerprint == HFTokenizer(from_file, tokenizer.eos_token_ids).fingerprint
    assert tokenizer.eos_token_ids == [from_file.convert_tokens_to_ids(from_file.eos_token)]


def test_a_replaced_file_gets_a_new_cache_folder(tmp_path):
    folder, kwargs = hf_source(SMOLLM2)
    copy = tmp_path / "model.gguf"
    shutil.copyfile(os.path.join(folder, kwargs["gguf_file"]), copy)
    before = cache_key(str(copy))
    os.utime(copy, ns=(1, 1))
    assert cache_key(str(copy)) != before
