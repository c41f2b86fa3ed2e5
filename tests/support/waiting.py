"""Waiting for a state, in a plain test, a thread or a coroutine."""

import asyncio
import inspect
import time


def wait_until(condition, timeout: float = 5.0, interval: float = 0.02, message: str = ""):
    """The one way a test waits for a state: polls condition() every `interval` seconds until it returns something
    true, and returns that; fails the test once `timeout` seconds have passed (with `message`, or the condition's
    name). In a coroutine, `await wait_until(...)`: it then sleeps on the event loop, and condition may be async.
    Anywhere else (a plain test, a thread) it blocks."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return wait_blocking(condition, timeout, interval, message)
    return wait_async(condition, timeout, interval, message)


def timed_out(condition, timeout: float, message: str) -> AssertionError:
    what = message
    if not what:
        try:
            what = inspect.getsource(condition).strip()  # a lambda: the line that waited
        except (OSError, TypeError):
            what = getattr(condition, "__qualname__", repr(condition))
    return AssertionError(f"waited {timeout} s in vain: {what}")


def wait_blocking(condition, timeout: float, interval: float, message: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise timed_out(condition, timeout, message)
        time.sleep(interval)
    return value


async def wait_async(condition, timeout: float, interval: float, message: str):
    async def check():
        value = condition()
        return await value if inspect.isawaitable(value) else value

    deadline = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() > deadline:
            raise timed_out(condition, timeout, message)
        await asyncio.sleep(interval)
    return value
