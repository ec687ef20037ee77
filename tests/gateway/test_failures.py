"""The gateway under failure, with the real ``openai`` client: hang-ups mid-stream, client
timeouts, API keys, back-pressure (429 and the client's retries), bad requests.

One engine for the module; two controllers + gateways over it: ``served`` (the lenient
default: the gateway key derived from the run secret, ``on_disconnect = "keep"``) and
``guarded`` (a key of the user's from a file, ``strict_model``, ``admission = "reject"``
with one episode at a time, ``on_disconnect = "drop"``)."""

from __future__ import annotations

import concurrent.futures
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from asyncrl.config import AlgoConfig, ControllerConfig, GatewayConfig, RunConfig
from asyncrl.engines.rollout.local.inproc import InProcEngine
from asyncrl.gateway import Gateway

from .conftest import Served

KEY = "sk-test-" + secrets.token_hex(12)
LONG = 4000  # a completion budget far beyond what runs before a hang-up (ignore_eos)


@pytest.fixture(scope="module")
def guarded(
    chat_model_dir: Path, engine: InProcEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    keyfile = tmp_path_factory.mktemp("key") / "gateway.key"
    keyfile.write_text(KEY + "\n")
    gw = GatewayConfig(
        enabled=True,
        max_tokens=16,
        api_key_file=str(keyfile),
        strict_model=True,
        admission="reject",
        retry_after_s=1,
        on_disconnect="drop",
    )
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=0),
        algo=AlgoConfig(group_size=1),
        gateway=gw,
    )
    s = Served(chat_model_dir, engine, cfg, advance=True)
    try:
        yield s
    finally:
        s.close()


def _sid() -> str:
    return uuid.uuid4().hex[:12]


async def _http(method: str, url: str, body: Any = None, key: str | None = None) -> Any:
    """One call to the gateway with its ``key``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, json=body, headers=headers) as r:
            return r.status, await r.json()


def _poll(what: str, ok: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.02)


def _engine_info(srv: Served) -> dict[str, Any]:
    return dict(srv.run(srv.engine.get_server_info()))


def _engine_idle(srv: Served) -> None:
    _poll("the engine to hold no request", lambda: _engine_info(srv)["num_requests"] == 0)


def _cut_after_first_tokens(srv: Served, base: str, msgs: list[Any], key: str) -> None:
    """A streamed completion of LONG tokens, read until its first content, then closed (the
    client hangs up)."""

    async def go() -> None:
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
        stream = await client.chat.completions.create(
            model=srv.gw.model,
            messages=msgs,
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()
        await client.close()

    srv.run(go())


def _aborted(srv: Served, tokens_before: int, disconnects_before: int) -> None:
    """The cut request was counted, and aborted at the engine: it holds no request, and far
    fewer than LONG tokens were made since."""
    _poll(
        "the gateway to count the hang-up",
        lambda: srv.gw.stats()["disconnects"] > disconnects_before,
    )
    _engine_idle(srv)
    assert _engine_info(srv)["tokens"] - tokens_before < LONG // 2


def test_hang_up_mid_stream_keeps_the_last_full_turn(served: Served) -> None:
    sid = _sid()
    base = f"{served.url}/sessions/{sid}/v1"
    client = openai.OpenAI(base_url=base, api_key=served.key, max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": "Hello!"}]
    r1 = client.chat.completions.create(model="t", messages=msgs, max_tokens=8)
    msgs += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Go on"},
    ]
    first = served.run(_http("GET", f"{served.url}/sessions/{sid}", key=served.key))[1]["branches"][
        0
    ]
    tokens, cuts = _engine_info(served)["tokens"], served.gw.stats()["disconnects"]
    _cut_after_first_tokens(served, base, msgs, served.key)
    _aborted(served, tokens, cuts)
    s = served.gw.sessions.by_id[sid]
    assert s.inflight == 0 and all(t.done.is_set() for t in s.turns.values())
    (b,) = served.run(_http("GET", f"{served.url}/sessions/{sid}", key=served.key))[1]["branches"]
    assert b == first  # the cut turn left nothing behind
    # the session goes on from its last full turn, on the same branch
    client.chat.completions.create(model="t", messages=msgs, max_tokens=8)
    snap = served.run(_http("GET", f"{served.url}/sessions/{sid}", key=served.key))[1]
    assert [b["turns"] for b in snap["branches"]] == [2] and snap["branches_opened"] == 0
    assert snap["branches"][0]["token_ids"][: len(first["token_ids"])] == first["token_ids"]
    n_batches = len(served.batches)
    assert (
        served.run(_http("POST", f"{served.url}/sessions/{sid}/reward", {"reward": 1}, served.key))[
            0
        ]
        == 200
    )
    _poll("the session's trajectory", lambda: len(served.batches) > n_batches)
    (traj,) = served.batches[n_batches].trajectories
    assert traj.metadata["session"] == sid
    out = snap["branches"][0]
    assert traj.response_ids.tolist() == out["token_ids"][out["prompt_len"] :]


def test_client_timeout_is_a_hang_up(served: Served) -> None:
    sid = _sid()
    base = f"{served.url}/sessions/{sid}/v1"
    tokens, cuts = _engine_info(served)["tokens"], served.gw.stats()["disconnects"]
    client = openai.OpenAI(base_url=base, api_key=served.key, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            model="t",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=LONG,
            extra_body={"ignore_eos": True},
        )
    _aborted(served, tokens, cuts)
    snap = served.run(_http("GET", f"{served.url}/sessions/{sid}", key=served.key))[1]
    assert not any(b["turns"] for b in snap["branches"]) and not snap["closed"]
    assert served.gw.sessions.by_id[sid].inflight == 0
    r = client.with_options(timeout=60).chat.completions.create(
        model="t", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert r.choices[0].message.content is not None
    assert (
        served.run(_http("POST", f"{served.url}/sessions/{sid}/reward", {"reward": 0}, served.key))[
            0
        ]
        == 200
    )


def test_api_key_from_a_file(guarded: Served) -> None:
    base = f"{guarded.url}/sessions/{_sid()}/v1"
    sessions = guarded.gw.stats()["sessions"]
    msgs = [{"role": "user", "content": "Hi"}]
    for key in ("wrong", KEY[:-1]):
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.chat.completions.create(model=guarded.gw.model, messages=msgs)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert key not in str(err.value.body)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    for url in (f"{base}/chat/completions", f"{guarded.url}/v1/chat/completions"):
        status, body = guarded.run(_http("POST", url, {"model": "x", "messages": msgs}))
        assert status == 401
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert guarded.run(_http("GET", f"{guarded.url}/stats", key="wrong"))[0] == 401
    assert guarded.gw.stats()["sessions"] == sessions  # none was opened
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [guarded.gw.model]


def test_reward_by_key_on_a_keyed_gateway(guarded: Served) -> None:
    """``POST /v1/reward`` names its session by the session's own key (what an agent-mode
    episode hands its client); the gateway's key names none (400); a missing or wrong key
    is a 401 before anything else."""
    sid = _sid()
    client = openai.OpenAI(base_url=f"{guarded.url}/sessions/{sid}/v1", api_key=KEY)
    client.chat.completions.create(
        model=guarded.gw.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    url = f"{guarded.url}/v1/reward"
    for key, status in ((None, 401), ("wrong", 401), (KEY, 400)):
        got, body = guarded.run(_http("POST", url, {"reward": 1}, key=key))
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}
    own = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=guarded.gw.sessions.by_id[sid].key)
    assert own.post("/reward", body={"reward": 0.75}, cast_to=object) == {
        "session": sid,
        "reward": 0.75,
    }


def test_api_key_sources(chat_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_TEST_GW_KEY", KEY)
    assert (
        Gateway(GatewayConfig(api_key_env="ASYNCRL_TEST_GW_KEY"), str(chat_model_dir)).api_key
        == KEY
    )
    with pytest.raises(ValueError, match="ASYNCRL_TEST_NOT_SET"):
        Gateway(GatewayConfig(api_key_env="ASYNCRL_TEST_NOT_SET"), str(chat_model_dir))
    with pytest.raises(ValueError, match="at most one"):
        Gateway(GatewayConfig(api_key_env="A", api_key_file="f"), str(chat_model_dir))
    with pytest.raises(ValueError, match="cannot read"):
        Gateway(GatewayConfig(api_key_file="/nonexistent/key"), str(chat_model_dir))


def test_unknown_model_and_bad_tools(guarded: Served) -> None:
    client = openai.OpenAI(
        base_url=f"{guarded.url}/sessions/{_sid()}/v1", api_key=KEY, max_retries=0
    )
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    bad_tools: list[Any] = [
        [{"type": "function", "function": {"name": 3}}],
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
        {"type": "function"},
    ]
    for tools in bad_tools:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=guarded.gw.model, messages=msgs, tools=tools)
        assert bad.value.status_code == 400 and str(bad.value.param).startswith("tools")


def test_back_pressure_429_then_the_clients_retry_gets_in(guarded: Served) -> None:
    gw, model = guarded.gw, guarded.gw.model
    msgs = [{"role": "user", "content": "Hi"}]
    a = _sid()
    # a session that fits is admitted: its first request is answered, not refused
    client_a = openai.OpenAI(base_url=f"{guarded.url}/sessions/{a}/v1", api_key=KEY, max_retries=0)
    client_a.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    # the run takes one episode at a time: a second session is refused, with Retry-After
    b = f"{guarded.url}/sessions/{_sid()}/v1"
    with pytest.raises(openai.RateLimitError) as err:
        openai.OpenAI(base_url=b, api_key=KEY, max_retries=0).chat.completions.create(
            model=model, messages=msgs, max_tokens=2
        )
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.code == "rate_limit_exceeded"
    # a client that retries (the SDK honours Retry-After) gets in once A's episode ended
    rejected = gw.stats()["rejected"]
    client_b = openai.OpenAI(base_url=b, api_key=KEY, max_retries=5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            client_b.chat.completions.create, model=model, messages=msgs, max_tokens=2
        )
        _poll("the gateway to refuse B once more", lambda: gw.stats()["rejected"] > rejected)
        assert not fut.done()
        url = f"{guarded.url}/sessions/{a}/reward"
        assert guarded.run(_http("POST", url, {"reward": 1}, KEY))[0] == 200
        r = fut.result(timeout=60)
    assert r.choices[0].finish_reason in ("stop", "length")
    sid_b = b.split("/")[-2]
    assert (
        guarded.run(_http("POST", f"{guarded.url}/sessions/{sid_b}/reward", {"reward": 0}, KEY))[0]
        == 200
    )


def test_hang_up_under_drop_drops_the_session(guarded: Served) -> None:
    sid = _sid()
    base = f"{guarded.url}/sessions/{sid}/v1"
    _poll("a free admission slot", lambda: guarded.ctl.staleness.can_admit())
    stats = guarded.gw.stats()
    tokens = _engine_info(guarded)["tokens"]
    n_batches = len(guarded.batches)
    _cut_after_first_tokens(guarded, base, [{"role": "user", "content": "Hi"}], KEY)
    _aborted(guarded, tokens, stats["disconnects"])
    _poll("the session to be dropped", lambda: guarded.gw.stats()["dropped"] > stats["dropped"])
    assert sid not in guarded.gw.sessions.by_id
    assert guarded.run(_http("GET", f"{guarded.url}/sessions/{sid}", key=KEY))[0] == 404
    # no trajectory came of it, and its slot is free again: the next session gets in at once
    assert len(guarded.batches) == n_batches
    _poll("the dropped session's admission slot freed", guarded.ctl.staleness.can_admit)
    client = openai.OpenAI(
        base_url=f"{guarded.url}/sessions/{_sid()}/v1", api_key=KEY, max_retries=0
    )
    r = client.chat.completions.create(
        model=guarded.gw.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert r.usage is not None and r.usage.completion_tokens <= 2
