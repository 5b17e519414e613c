"""How `connect()` reports a cluster it cannot reach or start, and its second try after a port
race. Plain tests: the unreachable address is a real closed port; a local start that fails is
Ray's `ray.init` replaced by a function that raises, because such a failure (another cluster
taking a port between its choice and Ray's bind) cannot be produced on demand here."""

from __future__ import annotations

import socket

import pytest
import ray

from hlm_ray.errors import HLMError
from hlm_ray.local_ray import TOKEN_NOTICE_LOGGER
from hlm_ray.train import launch


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: nothing listens there


@pytest.fixture
def no_cluster(monkeypatch):
    """As in a fresh process: no Ray joined yet (the test session's cluster stays untouched)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(launch, "starts_local", lambda address: not address or address == "local")


def test_an_unreachable_address_is_named_with_what_to_do(monkeypatch, no_cluster):
    port = closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(
        HLMError, match=f"cannot reach the Ray cluster at RAY_ADDRESS=127.0.0.1:{port}"
    ):
        launch.connect()


def fake_init(errors: list[Exception], calls: list[dict]):
    def init(address=None, **options):
        calls.append({"address": address, **options})
        if errors:
            raise errors.pop(0)

    return init


def test_a_local_start_that_fails_says_so_not_ray_address_none(monkeypatch, no_cluster):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls: list[dict] = []
    boom = RuntimeError("Failed to start the GCS server\nlog tail ...")
    monkeypatch.setattr(ray, "init", fake_init([boom, boom], calls))
    with pytest.raises(HLMError) as info:
        launch.connect()
    message = str(info.value)
    assert "could not start a local Ray cluster on this machine: Failed to start the GCS" in message
    assert "RAY_ADDRESS=None" not in message and "\n" not in message
    assert len(calls) == 1  # not a port race: no second try


def test_a_port_taken_during_a_local_start_is_tried_once_more_on_new_ports(monkeypatch, no_cluster):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls: list[dict] = []
    race = RuntimeError("Failed to bind to 127.0.0.1:38881 because it's already occupied")
    monkeypatch.setattr(ray, "init", fake_init([race], calls))
    launch.connect()
    assert len(calls) == 2
    assert calls[0]["dashboard_port"] != calls[1]["dashboard_port"]

    calls.clear()
    monkeypatch.setattr(ray, "init", fake_init([race, race], calls))
    with pytest.raises(HLMError, match="could not start a local Ray cluster.*already occupied"):
        launch.connect()
    assert len(calls) == launch.LOCAL_START_ATTEMPTS


def test_a_start_that_times_out_under_load_is_tried_again_then_one_line(monkeypatch, no_cluster):
    """Ray raises a bare Exception when its raylet has not registered within 30 s (seen with
    the load average at 17): it was a 30-line traceback through the sweep, with no word that the
    same command loses nothing. A second try often starts; a second timeout is one line."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    calls: list[dict] = []
    slow = Exception(
        "The current node timed out during startup. This could happen because some of the "
        "raylet failed to startup or the GCS has become overloaded."
    )
    monkeypatch.setattr(ray, "init", fake_init([slow], calls))
    launch.connect()
    assert len(calls) == 2

    calls.clear()
    monkeypatch.setattr(ray, "init", fake_init([slow, slow], calls))
    with pytest.raises(HLMError) as info:
        launch.connect()
    message = str(info.value)
    assert "\n" not in message and "timed out during startup" in message
    assert "load average" in message and "run the same command again" in message
    assert "continues where it stopped" in message


def test_a_local_start_keeps_rays_token_notice_off_the_console(monkeypatch, capfd, no_cluster):
    """Ray 2.60 turns token authentication on for a cluster ray.init starts, with a WARNING
    on every run (here Ray's own function, called where Ray calls it, in ray.init): `connect`
    keeps it off the console for a local start, and leaves the setting itself alone."""
    import logging
    import os

    from ray._private.authentication import authentication_token_setup as tokens

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    logger = logging.getLogger(TOKEN_NOTICE_LOGGER)
    monkeypatch.setattr(logger, "level", logging.NOTSET)  # as in a fresh process: restored
    monkeypatch.setattr(logger, "disabled", False)  # after the test
    assert logger is logging.getLogger(tokens.__name__)
    monkeypatch.setattr(ray, "init", lambda *a, **k: tokens._warn_token_auth_enabled())
    launch.connect()  # Ray's "ray" logger writes to stderr, and does not propagate
    assert "Token authentication" not in capfd.readouterr().err
    assert "RAY_AUTH_MODE" not in os.environ
