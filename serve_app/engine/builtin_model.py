"""Builtin models: ERNIE-4.5-architecture checkpoints made locally, with no download.

`builtin:ernie-4.5-tiny` is a miniature for CPU; `builtin:ernie-4.5-0.3b` has the exact shape of
ERNIE-4.5-0.3B for GPU benchmarks. Weights are random (seeded), so outputs are gibberish by design;
speed and memory are those of the real architecture. The tokenizer is a byte-level BPE trained on
the corpus committed beside this module, so every machine builds the same files and any UTF-8
text (Chinese included) round-trips. Special-token ids match ERNIE's: pad/unk 0, bos 1, eos 2.

A model is built once and cached under $SERVE_APP_CACHE_DIR (default ~/.cache/serve_app); the
cache key hashes the spec, the corpus and this module's format version, so a change rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from serve_app.constants import BUILTIN_PREFIX, CACHE_DIR_ENV, DEFAULT_CACHE_DIR, PACKAGE_DIR

CORPUS_PATH = PACKAGE_DIR / "model_data" / "corpus.txt"
_FORMAT_VERSION = 1
_SEED = 20251129
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>"]

# ERNIE-style turns ("User: ...", "Assistant: ..."); the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'Assistant: ' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class BuiltinSpec:
    """Architecture of one builtin model (Ernie4_5Config fields)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    trained_vocab_size: int
    max_position_embeddings: int


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    # Head dim 64 is one the CPU attention kernels support; 4 layers keep a step ~1 ms on 2 cores.
    "ernie-4.5-tiny": BuiltinSpec(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8192,
        trained_vocab_size=4096,
        max_position_embeddings=32768,
    ),
    # transformers.Ernie4_5Config() defaults: exactly ERNIE-4.5-0.3B.
    "ernie-4.5-0.3b": BuiltinSpec(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=18,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=103424,
        trained_vocab_size=4096,
        max_position_embeddings=131072,
    ),
}


class UnknownBuiltinModel(ValueError):
    pass


def is_builtin(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX)


def resolve_model(model: str) -> str:
    """A model reference vLLM can load: builtin names become a cached local directory."""
    return str(ensure_builtin(model.removeprefix(BUILTIN_PREFIX))) if is_builtin(model) else model


def ensure_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """Directory of the builtin model `name`, building it on first use (safe across processes)."""
    spec = BUILTIN_MODELS.get(name)
    if spec is None:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        raise UnknownBuiltinModel(f"unknown builtin model '{name}'; known: {known}")
    root = cache_dir or Path(os.environ.get(CACHE_DIR_ENV, DEFAULT_CACHE_DIR))
    target = root / "models" / f"{name}-{_cache_key(spec)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
            try:
                _build(spec, staging)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def _cache_key(spec: BuiltinSpec) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    h.update(CORPUS_PATH.read_bytes())
    h.update(CHAT_TEMPLATE.encode())
    h.update(f"v{_FORMAT_VERSION}-seed{_SEED}".encode())
    return h.hexdigest()[:12]


def build_tokenizer(spec: BuiltinSpec, out_dir: Path) -> None:
    """Train the byte-level BPE and save it as a transformers fast tokenizer with a chat template.

    The trained vocabulary is padded with reserved tokens up to the model's vocab size, as real
    checkpoints do, so every id the (random) model can sample decodes to some text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.trained_vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS_PATH)], trainer)
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    for i in range(len(vocab), spec.vocab_size):
        vocab[f"<|reserved_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(state))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<|begin_of_sentence|>",
        sep_token="<|end_of_sentence|>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_weights(spec: BuiltinSpec, out_dir: Path) -> None:
    """Seeded random weights of Ernie4_5ForCausalLM in bfloat16, saved as safetensors."""
    import torch
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM, GenerationConfig

    config = Ernie4_5Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    config.architectures = ["Ernie4_5ForCausalLM"]
    torch.manual_seed(_SEED)
    model = Ernie4_5ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(str(out_dir))


def _build(spec: BuiltinSpec, out_dir: Path) -> None:
    build_tokenizer(spec, out_dir)
    build_weights(spec, out_dir)
