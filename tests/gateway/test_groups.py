"""``algo.group_size > 1`` with client-opened sessions, with the real ``openai`` client: a
group's G episodes are G sessions ``GROUP.0 .. GROUP.{G-1}`` (each its own conversation,
reward and trajectory); a plain id is refused; a member that never comes times out."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from asyncrl.config import AlgoConfig, ControllerConfig, GatewayConfig, RunConfig
from asyncrl.engines.rollout.local.inproc import InProcEngine

from .conftest import Served
from .test_failures import _http, _poll

G = 2
TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def grouped(chat_model_dir: Path, engine: InProcEngine) -> Iterator[Served]:
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=200),
        algo=AlgoConfig(group_size=G),
        gateway=GatewayConfig(
            enabled=True, max_tokens=12, admission_timeout_s=10, session_timeout_s=TIMEOUT_S
        ),
    )
    s = Served(chat_model_dir, engine, cfg)
    try:
        yield s
    finally:
        s.close()


def _chat(client: openai.OpenAI, text: str) -> None:
    msgs = [{"role": "user", "content": text}]
    client.chat.completions.create(model="m", messages=msgs, max_tokens=8)  # type: ignore[arg-type]


def _batch_after(served: Served, n: int) -> Any:
    _poll("the group's batch", lambda: len(served.batches) > n)
    return served.batches[n]


def test_group_members_are_distinct_episodes(grouped: Served) -> None:
    """Two members of one group: two conversations, two trajectories (each its session's
    own ids and reward), one group in one batch. Before: both episodes bound one session
    and the same trajectories came back twice."""
    g = "grp" + uuid.uuid4().hex[:8]
    n = len(grouped.batches)
    snaps = {}
    for k, text in enumerate(["Hello!", "What is the weather in Oslo?"]):
        sid = f"{g}.{k}"
        _chat(openai.OpenAI(base_url=f"{grouped.url}/sessions/{sid}/v1", api_key=grouped.key), text)
        snaps[sid] = grouped.run(_http("GET", f"{grouped.url}/sessions/{sid}", key=grouped.key))[1]
    for k, reward in enumerate([1.0, 0.25]):
        url = f"{grouped.url}/sessions/{g}.{k}/reward"
        assert grouped.run(_http("POST", url, {"reward": reward}, grouped.key))[0] == 200
    batch = _batch_after(grouped, n)
    (group,) = batch.groups
    assert len(group) == G
    by_session = {t.metadata["session"]: t for t in group}
    assert set(by_session) == {f"{g}.0", f"{g}.1"}
    assert by_session[f"{g}.0"].reward == 1.0 and by_session[f"{g}.1"].reward == 0.25
    assert len({t.episode_id for t in group}) == G
    for sid, t in by_session.items():
        (b,) = snaps[sid]["branches"]
        assert list(t.prompt_ids) + list(t.response_ids) == b["token_ids"]
    assert batch.samples[0].session == g


def test_session_keys_name_members_too(grouped: Served) -> None:
    """A session key (``gw.session_key("GROUP.K")``, what a harness holding the gateway key
    derives for each agent it runs) opens member K of GROUP by itself, at ``/v1`` with no
    session in the path, and the same client posts its reward to ``base_url + "/reward"``
    (``/v1/reward``: the key names the session; the real client's own ``post``). The key
    opens nothing else: another member's path or ``/stats`` is 403."""
    g = "key" + uuid.uuid4().hex[:8]
    n = len(grouped.batches)
    keys = [grouped.gw.session_key(f"{g}.{k}") for k in range(G)]
    clients = [openai.OpenAI(base_url=f"{grouped.url}/v1", api_key=key) for key in keys]
    for k, client in enumerate(clients):
        _chat(client, f"Hi {k}")
    other = openai.OpenAI(base_url=f"{grouped.url}/sessions/{g}.1/v1", api_key=keys[0])
    with pytest.raises(openai.PermissionDeniedError):
        _chat(other, "Not mine")
    assert grouped.run(_http("GET", f"{grouped.url}/stats", key=keys[0]))[0] == 403
    for k, client in enumerate(clients):
        got = client.post("/reward", body={"reward": k + 0.5}, cast_to=object)
        assert got == {"session": f"{g}.{k}", "reward": k + 0.5}
    by_id = grouped.gw.sessions.by_id
    _poll("the ended session to be forgotten", lambda: f"{g}.0" not in by_id)
    with pytest.raises(openai.NotFoundError):  # its episode is over: no open session
        clients[0].post("/reward", body={"reward": 1}, cast_to=object)
    (group,) = _batch_after(grouped, n).groups
    assert {t.metadata["session"]: t.reward for t in group} == {f"{g}.0": 0.5, f"{g}.1": 1.5}


def test_reward_at_base_url_and_bad_rewards(grouped: Served) -> None:
    """``POST {base_url}/reward`` for a session named in the URL too; bad input is a 4xx in
    OpenAI's error JSON: the gateway key on ``/v1/reward`` (no session named) 400, the key
    of no open session 404, a reward
    that is no number 400 naming ``reward`` (the session stays open and takes a good one)."""
    g = "rw" + uuid.uuid4().hex[:8]
    n = len(grouped.batches)
    for k in range(G):
        client = openai.OpenAI(base_url=f"{grouped.url}/sessions/{g}.{k}/v1", api_key=grouped.key)
        _chat(client, "Hello!")
        for bad in ({"reward": "1"}, {"reward": True}, {"score": 1}, [1]):
            with pytest.raises(openai.BadRequestError) as err:
                client.post("/reward", body=bad, cast_to=object)
            assert err.value.param == "reward"
        assert client.post("/reward", body={"reward": -k}, cast_to=object)["reward"] == -k
    url = f"{grouped.url}/v1/reward"
    status, body = grouped.run(_http("POST", url, {"reward": 1}, grouped.key))
    assert status == 400 and "name a session" in body["error"]["message"]
    key = grouped.gw.session_key(f"nosuch{uuid.uuid4().hex[:8]}.0")
    status, body = grouped.run(_http("POST", url, {"reward": 1}, key))
    assert status == 404 and body["error"]["type"] == "not_found"
    (group,) = _batch_after(grouped, n).groups
    assert sorted(t.reward for t in group) == [-1.0, 0.0]


def test_plain_id_or_member_out_of_range_is_400(grouped: Served) -> None:
    g = "plain" + uuid.uuid4().hex[:8]
    for sid, needle in [(g, "GROUP.K"), (f"{g}.{G}", f"0..{G - 1}"), ("a.b", "GROUP.K")]:
        client = openai.OpenAI(base_url=f"{grouped.url}/sessions/{sid}/v1", api_key=grouped.key)
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, "Hello!")
        assert needle in str(err.value)
    assert not any(name.startswith(g) for name in grouped.gw.sessions.groups)
    key = grouped.gw.session_key(g)  # a plain id by its session key: refused the same way
    with pytest.raises(openai.BadRequestError, match=r"GROUP\.K"):
        _chat(openai.OpenAI(base_url=f"{grouped.url}/v1", api_key=key), "Hello!")


def test_member_that_never_comes_times_out(grouped: Served) -> None:
    """Only member 0 talks: member 1's episode waits ``session_timeout_s`` for it, is
    dropped (counted), and the group trains on member 0 alone."""
    g = "lone" + uuid.uuid4().hex[:8]
    n = len(grouped.batches)
    timed_out = grouped.gw.sessions.counters["timed_out"]
    _chat(openai.OpenAI(base_url=f"{grouped.url}/sessions/{g}.0/v1", api_key=grouped.key), "Hello!")
    url = f"{grouped.url}/sessions/{g}.0/reward"
    assert grouped.run(_http("POST", url, {"reward": 1}, grouped.key))[0] == 200
    (group,) = _batch_after(grouped, n).groups
    assert [t.metadata["session"] for t in group] == [f"{g}.0"]
    assert grouped.gw.sessions.counters["timed_out"] == timed_out + 1
    assert f"{g}.1" not in grouped.gw.sessions.by_id


def test_naming_an_ended_member_while_its_partner_is_open_is_409(
    chat_model_dir: Path, engine: InProcEngine
) -> None:
    """Member 0 ends (its reward) while member 1 of its group, unnamed, still waits for its
    client: naming member 0 again would open a new group whose member 1 could not be opened
    (its id is taken): 409 naming the open member, and the run goes on (member 1 then
    named, the group trains). Before: the new group's episode raised ("session 'G.1'
    exists already") and ended the run (found by probing a real agent run's gateway)."""
    cfg = RunConfig(
        controller=ControllerConfig(batch_size=1, max_staleness=200),
        algo=AlgoConfig(group_size=G),
        gateway=GatewayConfig(enabled=True, max_tokens=8, session_timeout_s=120),
    )
    srv = Served(chat_model_dir, engine, cfg)
    try:
        g = "again" + uuid.uuid4().hex[:8]
        first = openai.OpenAI(base_url=f"{srv.url}/sessions/{g}.0/v1", api_key=srv.key)
        _chat(first, "Hello!")
        assert first.post("/reward", body={"reward": 1}, cast_to=object)["reward"] == 1
        _poll("member 0 forgotten", lambda: f"{g}.0" not in srv.gw.sessions.by_id)
        assert f"{g}.1" in srv.gw.sessions.by_id  # its episode waits for a client
        with pytest.raises(openai.ConflictError, match=f"{g}.1"):
            _chat(first, "Hello again!")
        second = openai.OpenAI(base_url=f"{srv.url}/sessions/{g}.1/v1", api_key=srv.key)
        _chat(second, "Hi!")
        second.post("/reward", body={"reward": 0}, cast_to=object)
        (group,) = _batch_after(srv, 0).groups
        assert sorted(t.metadata["session"] for t in group) == [f"{g}.0", f"{g}.1"]
    finally:
        srv.close()
