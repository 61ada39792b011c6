"""A tiny stand-in model directory: ByteLevel BPE tokenizer, Qwen-style chat template, Qwen2 config.

This is a **stand-in model** for the CPU harness, not a language model anyone should sample
from: nothing in the harness runs its forward pass (generation comes from
:class:`otel_verl.demo.llm_server_standin.LLMServerStandIn`, log-probs from the worker-group
stand-ins). What it provides is everything verl reads from a model directory when the GPU
parts are replaced:

* ``tokenizer.json`` / ``tokenizer_config.json``: a ByteLevel BPE tokenizer of a few hundred
  tokens trained locally with the ``tokenizers`` library, with the ChatML specials
  ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` and the hermes tool tags
  ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``
  (added as non-special tokens, as in Qwen2.5, so decoding keeps them);
* ``chat_template.jinja`` (also inlined in ``tokenizer_config.json``): a Qwen2.5-style
  template that renders ``tools`` in the hermes format verl's ``ToolAgentLoop`` and
  ``HermesToolParser`` expect;
* ``config.json``: a ``Qwen2Config`` (``model_type=qwen2``, 1 layer, hidden size 32) so
  ``HFModelConfig(path=dir)`` and verl's Continuous-Token builder (which picks the Qwen
  ChatML boundary rules from ``model_type``) treat it like a Qwen2 checkpoint;
* ``generation_config.json``.

No weights are written. Everything is built offline (no model hub) in a few seconds and
cached by content: :func:`ensure_tiny_model` rebuilds a directory only when the recipe in this
file changes.

    from otel_verl.demo.tiny_model import ensure_tiny_model
    path = ensure_tiny_model("/tmp/tiny-qwen2")      # or ensure_tiny_model() for the user cache
    from verl.workers.config import HFModelConfig
    HFModelConfig(path=path).tokenizer.apply_chat_template([...], tools=[...], tokenize=False)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import List, Optional

STANDIN_NAME = "otel-verl-tiny-qwen2-standin"
RECIPE_VERSION = "2"
VOCAB_SIZE = 512
HIDDEN_SIZE = 32
STAMP_FILE = ".otel_verl_tiny_model"

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Qwen2.5 adds the hermes tags as added (non-special) tokens: decode() keeps them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's chat template (hermes tool calling), with the stand-in's default system prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) '
    'or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {%- if tool_call.arguments is string %}\n"
    "                {{- tool_call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _training_corpus() -> List[str]:
    """Text the BPE merges are learned from: the template, the demo prompts and answers."""
    from otel_verl.demo import data as demo_data

    lines = [
        DEFAULT_SYSTEM_PROMPT,
        "# Tools",
        "You may call one or more functions to assist with the user query.",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        '{"type": "function", "function": {"name": "calculator", "description": '
        '"Add two numbers a and b and return the sum.", "parameters": {"type": "object", '
        '"properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}',
        '{"name": "calculator", "arguments": {"a": 12, "b": 30}}',
        "Let me use the calculator.",
        "The calculator says the total is 42. #### 42",
        "The answer is 42.",
        demo_data.INSTRUCTION,
        demo_data.TOOL_SYSTEM_PROMPT,
    ]
    for row in demo_data.problems(64, seed=1234):
        lines.append(row["question"])
    lines.extend(" ".join(str(i) for i in range(start, start + 10)) for start in range(0, 200, 10))
    return lines * 4


def recipe_digest() -> str:
    """Digest of everything that determines the built files (recipe version, template, corpus)."""
    h = hashlib.sha256()
    for part in (RECIPE_VERSION, str(VOCAB_SIZE), str(HIDDEN_SIZE), CHAT_TEMPLATE, *SPECIAL_TOKENS, *TOOL_TOKENS):
        h.update(part.encode())
        h.update(b"\0")
    for line in _training_corpus():
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def default_model_dir() -> str:
    """The user-cache location used when no directory is given (``OTEL_VERL_DEMO_CACHE`` overrides)."""
    root = os.environ.get("OTEL_VERL_DEMO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otel_verl", "demo"
    )
    return os.path.join(root, f"tiny-qwen2-{recipe_digest()}")


def is_built(directory: str, digest: Optional[str] = None) -> bool:
    try:
        with open(os.path.join(directory, STAMP_FILE)) as f:
            return f.read().strip() == (digest or recipe_digest())
    except OSError:
        return False


def ensure_tiny_model(directory: Optional[str] = None) -> str:
    """Build the stand-in model into ``directory`` unless it already holds this recipe's build.

    The build is written to a temporary sibling and renamed into place, so concurrent callers
    and interrupted builds never leave a half-written directory behind. Returns the absolute path.
    """
    directory = os.path.abspath(directory or default_model_dir())
    digest = recipe_digest()
    if is_built(directory, digest):
        return directory
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        _build(tmp)
        with open(os.path.join(tmp, STAMP_FILE), "w") as f:
            f.write(digest + "\n")
        if os.path.isdir(directory):
            if is_built(directory, digest):  # someone else finished first
                return directory
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _build(out: str) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

    tok = Tokenizer(models.BPE(unk_token=None))
    # Qwen2's pre-tokenizer (digits split one by one); transformers' Qwen2Tokenizer, which
    # AutoTokenizer picks from model_type=qwen2, installs this same one on load.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.padding_side = "left"
    hf_tok.save_pretrained(out)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    # Inline the template too, for loaders that only read tokenizer_config.json.
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2)

    vocab_size = len(hf_tok)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=hf_tok.convert_tokens_to_ids(IM_END),
        pad_token_id=hf_tok.convert_tokens_to_ids(ENDOFTEXT),
        architectures=["Qwen2ForCausalLM"],
    )
    config.name_or_path = STANDIN_NAME
    config.save_pretrained(out)
    GenerationConfig(
        eos_token_id=[hf_tok.convert_tokens_to_ids(IM_END), hf_tok.convert_tokens_to_ids(ENDOFTEXT)],
        pad_token_id=hf_tok.convert_tokens_to_ids(ENDOFTEXT),
    ).save_pretrained(out)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(
            f"# {STANDIN_NAME}\n\nStand-in model built by otel_verl.demo.tiny_model for the CPU harness: "
            "a ByteLevel BPE tokenizer, a Qwen2.5-style chat template with hermes tool calling and a "
            "1-layer Qwen2 config. No weights; never sample from it.\n"
        )


if __name__ == "__main__":
    import sys

    print(ensure_tiny_model(sys.argv[1] if len(sys.argv) > 1 else None))
