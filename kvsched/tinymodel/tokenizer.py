"""A small byte-level BPE tokenizer, trained offline on the English text shipped beside this
file, saved as a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with
bos/eos tokens and a ChatML-style chat template) that `transformers.AutoTokenizer` and vLLM
load. Together with a random-weight model of the same vocabulary it makes a servable model
directory without any download.

    make_tokenizer("/tmp/tiny", vocab_size=512)

Special tokens take the first ids, as Llama's do: 0 `<unk>`, 1 `<s>` (bos), 2 `</s>` (eos),
3 `<|im_start|>`, 4 `<|im_end|>` (chat turns). Every id below `vocab_size` decodes: 256 byte
tokens and merges learned from the corpus fill the rest.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

UNK, BOS, EOS, IM_START, IM_END = "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS, IM_START, IM_END)
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2

# ChatML turns, opened by bos: what Qwen's and many Llama fine-tunes' templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus_text() -> str:
    """The English text the tokenizer is trained on (shipped in the package)."""
    return files("kvsched.tinymodel").joinpath("corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int = 512) -> object:
    """A `tokenizers.Tokenizer` (byte-level BPE) of exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be >= {min_size} (specials + 256 bytes), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_text()
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the shipped corpus yields {tok.get_vocab_size()} tokens, fewer than vocab_size "
            f"{vocab_size}: use a smaller vocab_size"
        )
    # Like Llama's tokenizers: encoding a plain prompt puts bos first.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_TOKEN_ID)]
    )
    return tok


def make_tokenizer(directory: str | Path, vocab_size: int = 512) -> Path:
    """Train the tokenizer and save it into `directory` (created if needed) as tokenizer.json
    and tokenizer_config.json (bos, eos, unk, chat template). Returns the directory."""
    from transformers import PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=train_tokenizer(vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
    )
    fast.save_pretrained(str(out))
    # The template inside tokenizer_config.json (not a separate chat_template.jinja), which
    # every transformers version that has chat templates reads.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHAT_TEMPLATE
    # Names every transformers version knows (5.x writes its own backend's class name and
    # "extra_special_tokens", which 4.x, as vLLM may pin it, does not read).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
