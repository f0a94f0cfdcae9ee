"""In-process stand-ins for Serve deployment handles, for running the app's parts without Ray.

`LocalHandle(obj).method.remote(*args)` calls `obj.method` as Serve would: an async generator
comes back as a stream that can be iterated and cancelled (Serve's DeploymentResponseGenerator),
anything else as an awaitable of its result. With them, a RequestPipeline serves from replicas
and a pool-state board in the same process (tests, the fake engine).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast


class LocalStream:
    """An async generator's output, with Serve's `cancel()`."""

    def __init__(self, gen: AsyncGenerator[Any, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        asyncio.get_running_loop().create_task(self._gen.aclose())


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **kwargs)
        if inspect.isasyncgen(result):
            return LocalStream(cast(AsyncGenerator[Any, None], result))
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        return _done(result)


def _done(value: Any) -> Awaitable[Any]:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class LocalHandle:
    """`handle.method.remote(...)` on an object in this process."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name))

    def options(self, **_: Any) -> LocalHandle:
        return self
