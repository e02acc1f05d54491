"""Minting session tokens (docs/http.md, "Putting a bot on a public page"; docs/cli.md, `token`):
a token lasts at most 7 days, and a longer one is refused when it is minted, with an error that
names the limit, by `DialogClient.session_token` and by `dialog-worker token` alike."""

from __future__ import annotations

import json
import math
import time

import pytest

from dialog_worker import cli
from dialog_worker.client import session_tokens
from dialog_worker.client.dialog_client import DialogClient
from dialog_worker.config import Settings
from dialog_worker.errors import ValidationError

KEY = "t" * 40
SEVEN_DAYS_S = 7 * 86400


@pytest.fixture
async def local_client():
    # No Redis call: a token is signed with the settings' key, nothing is stored.
    made = DialogClient(settings=Settings(http_signing_key=KEY))
    yield made
    await made.aclose()


async def test_a_token_lasts_at_most_seven_days_and_a_longer_one_is_refused_at_minting(
    local_client: DialogClient,
):
    before = time.time()
    longest = local_client.session_token("s1", ttl_s=SEVEN_DAYS_S)
    grant = session_tokens.verify(KEY, longest)
    assert grant.session_id == "s1"
    assert SEVEN_DAYS_S - 2 <= grant.expires_at - before <= SEVEN_DAYS_S + 1
    for too_long in (SEVEN_DAYS_S + 1, SEVEN_DAYS_S + 0.5, 30 * 86400, math.inf):
        with pytest.raises(ValidationError) as refused:
            local_client.session_token("s1", ttl_s=too_long)
        assert "604800" in str(refused.value) and "7 days" in str(refused.value)
    for not_a_lifetime in (0, -1, math.nan, True):
        with pytest.raises(ValidationError):
            local_client.session_token("s1", ttl_s=not_a_lifetime)


def test_cli_token_refuses_a_ttl_past_seven_days_and_prints_no_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv("DIALOG_HTTP_SIGNING_KEY", KEY)
    assert cli.main(["token", "s1", "--ttl", str(SEVEN_DAYS_S + 1)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "604800" in err and "7 days" in err and KEY not in err
    assert cli.main(["token", "s1", "--ttl", str(SEVEN_DAYS_S)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["expires_at"] - time.time() > SEVEN_DAYS_S - 60
    assert session_tokens.verify(KEY, printed["token"]).session_id == "s1"
