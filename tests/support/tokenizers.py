"""Offline tokenizers for tests."""

from __future__ import annotations


def char_tokenizer():
    """A character-level fast tokenizer built offline: ids 0-3 special (<pad>, <s>, </s>, <unk>), then
    printable ASCII (99 ids in all), so every generated id decodes to one character or a special token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
