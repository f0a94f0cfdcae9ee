import json

from serve_app.ingress import openai_format as fmt


def event(data: bytes) -> dict[str, object]:
    text = data.decode()
    assert text.startswith("data: ") and text.endswith("\n\n")
    parsed: dict[str, object] = json.loads(text[6:])
    return parsed


def test_chat_chunks_carry_the_role_first() -> None:
    first = event(fmt.chunk_event(fmt.Kind.CHAT, "id", 1, "m", "Hi", None, first=True))
    later = event(fmt.chunk_event(fmt.Kind.CHAT, "id", 1, "m", "!", "stop", first=False))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "Hi"},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert later["choices"][0]["delta"] == {"content": "!"}  # type: ignore[index]


def test_completion_chunk_and_full_bodies() -> None:
    chunk = event(fmt.chunk_event(fmt.Kind.COMPLETION, "id", 1, "m", "x", "length", first=True))
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [
        {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}
    ]
    full = fmt.full_response(fmt.Kind.CHAT, "id", 1, "m", "hello", "stop", 3, 2)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    usage = event(fmt.usage_event(fmt.Kind.COMPLETION, "id", 1, "m", 3, 2))
    assert usage["choices"] == [] and usage["object"] == "text_completion"
    assert fmt.DONE == b"data: [DONE]\n\n"
