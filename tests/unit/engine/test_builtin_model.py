import hashlib
from pathlib import Path

import pytest

from serve_app.engine.builtin_model import (
    BUILTIN_MODELS,
    UnknownBuiltinModel,
    ensure_builtin,
    resolve_model,
)


def digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin("ernie-4.5-tiny", tmp_path_factory.mktemp("a"))


def test_build_is_deterministic(tiny: Path, tmp_path: Path) -> None:
    again = ensure_builtin("ernie-4.5-tiny", tmp_path)
    assert again.name == tiny.name
    assert digest(again) == digest(tiny)
    assert "model.safetensors" in digest(tiny)


def test_cached_build_is_reused(tiny: Path) -> None:
    before = (tiny / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("ernie-4.5-tiny", tiny.parent.parent) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == before


def test_config_is_ernie_architecture(tiny: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny)
    assert config.architectures == ["Ernie4_5ForCausalLM"]
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.vocab_size == BUILTIN_MODELS["ernie-4.5-tiny"].vocab_size


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "人工智能正在改变我们的生活。", "emoji 🚀 and ∑√∞", "混合 text 123 ünïcödé"],
)
def test_any_utf8_round_trips(tiny: Path, text: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens_match_ernie(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == BUILTIN_MODELS["ernie-4.5-tiny"].vocab_size
    # every id the model can sample decodes to text
    assert tok.decode([len(tok) - 1])


def test_chat_template_opens_an_assistant_turn(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<s>Be brief.\nUser: 你好\nAssistant: "


def test_unknown_builtin_is_refused() -> None:
    with pytest.raises(UnknownBuiltinModel, match=r"known: builtin:ernie-4\.5-tiny"):
        resolve_model("builtin:gpt-5")


def test_non_builtin_passes_through() -> None:
    assert resolve_model("baidu/ERNIE-4.5-0.3B-PT") == "baidu/ERNIE-4.5-0.3B-PT"
