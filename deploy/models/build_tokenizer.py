"""Builds the bench model's tokenizer (deploy/models/bench-qwen3): byte-level BPE trained with `tokenizers`.

    python deploy/models/build_tokenizer.py [--out deploy/models/bench-qwen3]

The corpus is text that ships with Python itself (a fixed list of standard-library modules), so
nothing is downloaded. The vocabulary size matches the model's config.json; the special tokens
and the chat template follow Qwen's ChatML layout, so chat requests work against the model.
`kvferry bench multiturn` builds its prompts from this tokenizer's ids (kvferry.bench.multiturn_workload).
The test model (deploy/models/tiny-qwen3) has Qwen3's real tokenizer instead (kvferry.stack.tiny_model).
Outputs: tokenizer.json and tokenizer_config.json (committed; rerun only to change them).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS_MODULES = [
    "argparse", "asyncio.base_events", "collections", "dataclasses", "email.message", "enum",
    "functools", "http.client", "inspect", "json.decoder", "logging", "pathlib", "pydoc",
    "shutil", "string", "subprocess", "textwrap", "threading", "typing", "unittest.case",
    "urllib.parse", "zipfile",
]  # fmt: skip
# ChatML; with tools, Qwen3's tool framing (the tools in the system message, an assistant's calls as
# <tool_call> JSON after its text), so the agent workload's requests render as an agent's would.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus() -> Iterator[str]:
    for name in CORPUS_MODULES:
        source = inspect.getsource(importlib.import_module(name))
        for start in range(0, len(source), 4096):
            yield source[start : start + 4096]


def build(out: Path, vocab_size: int) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise SystemExit(f"trained {tokenizer.get_vocab_size()} tokens, more than vocab_size {vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    print(f"wrote {out}: {tokenizer.get_vocab_size()} tokens, special ids {ids}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=HERE / "bench-qwen3")
    args = parser.parse_args()
    config = json.loads((args.out / "config.json").read_text())
    build(args.out, int(config["vocab_size"]))


if __name__ == "__main__":
    main()
