"""The Chainlit chat page (run by `serve-app chat`; `chainlit run` loads this file).

Every turn is an OpenAI chat completion streamed from the app, with the conversation so far and
the SLO chosen in the settings panel; under each answer, the pool that served it, why, the first
token's latency and the decode speed. The app's refusals (429, 503, 4xx) read as messages; while
the engines load, the page says so and waits.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, cast

import chainlit as cl
import httpx
from chainlit.input_widget import Select, Slider, Switch, TextInput
from openai import APIConnectionError, APIError, APIStatusError, AsyncOpenAI, AsyncStream
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from serve_app.chat.turn import SLO_CLASSES, Settings, TurnStats, refusal_text

APP_URL = os.environ.get("SERVE_APP_URL", "http://127.0.0.1:8000").rstrip("/")
API_KEY = os.environ.get("SERVE_APP_API_KEY", "unused")  # the app's key, when it has keys
READY_WAIT_S = float(os.environ.get("SERVE_APP_CHAT_READY_WAIT_S", "900"))
READY_POLL_S = 5.0
# the settings panel's starting values (serve-app chat --max-tokens sets the first)
DEFAULTS = Settings(max_tokens=int(os.environ.get("SERVE_APP_CHAT_MAX_TOKENS", "256")))
AUTHOR = "serve-app"

client = AsyncOpenAI(base_url=f"{APP_URL}/v1", api_key=API_KEY, max_retries=0, timeout=600)
AUTH = {"Authorization": f"Bearer {API_KEY}"}  # for the app's own endpoints (/pools)


def _panel() -> cl.ChatSettings:
    defaults = DEFAULTS
    return cl.ChatSettings(
        [
            Select(
                id="slo_class",
                label="SLO class",
                values=list(SLO_CLASSES),
                initial_index=SLO_CLASSES.index(defaults.slo_class),
                description="x-slo-class: the latency targets the router must meet.",
            ),
            TextInput(
                id="ttft_ms",
                label="TTFT target (ms)",
                initial="",
                placeholder="the class's",
                description="x-slo-ttft-ms (optional)",
            ),
            TextInput(
                id="tpot_ms",
                label="TPOT target (ms)",
                initial="",
                placeholder="the class's",
                description="x-slo-tpot-ms (optional)",
            ),
            Slider(
                id="max_tokens",
                label="Max tokens",
                initial=defaults.max_tokens,
                min=16,
                max=2048,
                step=16,
            ),
            Slider(
                id="temperature",
                label="Temperature",
                initial=defaults.temperature,
                min=0,
                max=2,
                step=0.1,
            ),
            Switch(
                id="truncate",
                label="Cut long prompts to their head and tail (default 384 + 128 tokens)",
                initial=defaults.truncate,
            ),
        ]
    )


async def _say(text: str) -> cl.Message:
    message = cl.Message(content=text, author=AUTHOR)
    await message.send()
    return message


async def wait_until_ready() -> bool:
    """Poll /ready (503 while the engines load), saying on the page what it waits for."""
    notice: cl.Message | None = None
    deadline = time.monotonic() + READY_WAIT_S
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            try:
                r = await http.get(f"{APP_URL}/ready")
                if r.status_code == 200:
                    if notice is not None:
                        notice.content = "The engines are ready: ask away."
                        await notice.update()
                    return True
                state = f"The engines are loading ({r.text[:200]}); checking every 5 s."
            except httpx.HTTPError:
                state = f"Cannot reach the app at {APP_URL} yet; checking every 5 s."
            if time.monotonic() > deadline:
                await _say(f"Gave up waiting for the app after {READY_WAIT_S:.0f} s: {state}")
                return False
            if notice is None:
                notice = await _say(state)
            elif notice.content != state:
                notice.content = state
                await notice.update()
            await asyncio.sleep(READY_POLL_S)


async def _model() -> str:
    models = await client.models.list()
    return models.data[0].id


@cl.on_chat_start
async def start() -> None:
    values = await _panel().send()
    cl.user_session.set("settings", Settings.from_panel(values))
    cl.user_session.set("history", [])
    if not await wait_until_ready():
        return
    try:
        model = await _model()
        async with httpx.AsyncClient(timeout=5, headers=AUTH) as http:
            r = await http.get(f"{APP_URL}/pools")
            r.raise_for_status()
            pools = sorted(r.json())
    except (APIError, httpx.HTTPError, ValueError) as e:  # e.g. a key the app refuses
        await _say(f"Reached {APP_URL}, but it answered: {str(e)[:300]}")
        return
    cl.user_session.set("model", model)
    await _say(
        f"Connected to {APP_URL}: model `{model}`, engine pools {', '.join(pools)}. "
        "The sliders icon by the input sets the SLO; under each answer: the pool that "
        "served it and why."
    )


@cl.on_settings_update
async def update_settings(values: dict[str, Any]) -> None:
    cl.user_session.set("settings", Settings.from_panel(values))


async def _answer(history: list[ChatCompletionMessageParam], settings: Settings) -> str | None:
    """Stream one answer into the page; its text, or None when the app refused it."""
    stats = TurnStats(sent_at=time.monotonic())
    create = client.chat.completions.with_raw_response.create
    for attempt in range(2):
        try:
            model = cl.user_session.get("model") or await _model()
            cl.user_session.set("model", model)
            raw = await create(model=model, messages=history, **settings.request())
            break
        except APIStatusError as e:
            retry_after = e.response.headers.get("retry-after")
            if e.status_code == 503 and attempt == 0 and await wait_until_ready():
                stats.sent_at = time.monotonic()
                continue  # the engines were (re)loading: once more
            await _say(refusal_text(e.status_code, e.body, retry_after))
            return None
        except APIConnectionError:
            await _say(f"Cannot reach the app at {APP_URL}: is `make run` running?")
            return None
    stats.read_headers(raw.headers)
    answer = cl.Message(content="", author="assistant")
    text: list[str] = []
    stopped = ""
    try:
        async for chunk in cast(AsyncStream[ChatCompletionChunk], raw.parse()):
            if chunk.usage is not None:
                stats.read_usage(chunk.usage)
            for choice in chunk.choices:
                if choice.delta.content:
                    stats.token(time.monotonic())
                    text.append(choice.delta.content)
                    await answer.stream_token(choice.delta.content)
    except APIError as e:  # an error event mid-stream (the engine failed): say it, keep the text
        stopped = f"\n\n*The answer stopped: {e.message}*"
    answer.content = "".join(text) + stopped + f"\n\n---\n{stats.footer()}"
    await answer.send()
    return "".join(text)


@cl.on_message
async def respond(message: cl.Message) -> None:
    history: list[ChatCompletionMessageParam] = cl.user_session.get("history") or []
    settings: Settings = cl.user_session.get("settings") or DEFAULTS
    history.append({"role": "user", "content": message.content})
    reply = await _answer(history, settings)
    if reply is None:
        history.pop()  # refused: the conversation goes on without that turn
    else:
        history.append({"role": "assistant", "content": reply})
    cl.user_session.set("history", history)
