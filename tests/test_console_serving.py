"""`codegym console` as a process, without a runtime behind it (sign-in needs none): under TLS the
login cookie is Secure, HttpOnly and Strict and plain HTTP is not served; without tokens it refuses
to bind beyond loopback unless `--insecure`; the probes answer without a login, `/ready` says 503
while the runtime does not answer; pages send headers that forbid framing and foreign scripts; and
`codegym up --console-port` starts it behind up's tokens."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from codegym.procs import codegym_command, free_port
from codegym.server.auth import OPERATOR, TRAINER, Identity, write_tokens
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_testkit.access import self_signed
from codegym_testkit.waiting import wait_until
from tests.helpers.servers import CodegymServer

ENV = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV, "CODEGYM_TOKENS_FILE")}
NOWHERE = f"127.0.0.1:{free_port()}"  # no runtime listens there


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


@pytest.fixture(scope="module")
def tls_console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ssl.SSLContext]]:
    folder = tmp_path_factory.mktemp("console-tls")
    cert, key = self_signed(folder)
    tokens = folder / "tokens.json"
    write_tokens(tokens, {"trainer-a": Identity("team-a", TRAINER), "ops": Identity("ops", OPERATOR)})
    args = ["console", "--target", NOWHERE, "--port", "0", "--tokens", str(tokens)]
    console = CodegymServer([*args, "--tls-cert", str(cert), "--tls-key", str(key)], env=ENV)
    context = ssl.create_default_context(cafile=str(cert))
    try:
        yield console.address, context
    finally:
        assert console.stop() == 0, console.text[-2000:]


def test_under_tls_the_login_cookie_is_secure_http_only_and_strict(
    tls_console: tuple[str, ssl.SSLContext],
) -> None:
    address, context = tls_console
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), NoRedirect)
    body = urllib.parse.urlencode({"token": "trainer-a", "next": "/library"}).encode()
    with pytest.raises(urllib.error.HTTPError) as answer:  # the 303 to the page, not followed
        opener.open(urllib.request.Request(f"https://{address}/login", data=body), timeout=10)
    assert answer.value.code == 303 and answer.value.headers["Location"] == "/library"
    cookie = answer.value.headers["Set-Cookie"]
    assert "trainer-a" not in cookie
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "secure", "samesite=strict", "path=/"} <= flags, cookie
    wrong = urllib.parse.urlencode({"token": "nope"}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        opener.open(urllib.request.Request(f"https://{address}/login", data=wrong), timeout=10)
    assert refused.value.code == 401 and "Set-Cookie" not in refused.value.headers
    # A sign-in posted from another site's page (login CSRF) is refused, and sets no cookie.
    foreign = urllib.request.Request(
        f"https://{address}/login", data=body, headers={"Origin": "https://elsewhere.example"}
    )
    with pytest.raises(urllib.error.HTTPError) as cross:
        opener.open(foreign, timeout=10)
    assert cross.value.code == 403 and "Set-Cookie" not in cross.value.headers
    with pytest.raises(OSError):  # no plain HTTP on the TLS port (a refusal or a dropped connection)
        urllib.request.urlopen(f"http://{address}/live", timeout=5).read()


def test_probes_answer_without_a_login_and_ready_needs_the_runtime(
    tls_console: tuple[str, ssl.SSLContext],
) -> None:
    address, context = tls_console
    with urllib.request.urlopen(f"https://{address}/live", timeout=10, context=context) as live:
        assert live.status == 200
    with pytest.raises(urllib.error.HTTPError) as ready:
        urllib.request.urlopen(f"https://{address}/ready", timeout=10, context=context)
    assert ready.value.code == 503 and "runtime unavailable" in ready.value.read().decode()


def test_pages_forbid_framing_and_foreign_scripts(tls_console: tuple[str, ssl.SSLContext]) -> None:
    address, context = tls_console
    with urllib.request.urlopen(f"https://{address}/login", timeout=10, context=context) as page:
        headers = page.headers
        html = page.read().decode()
    assert (
        headers["X-Frame-Options"] == "DENY"
        and "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    )
    assert "script-src 'self'" in headers["Content-Security-Policy"] and "<script>" not in html


def test_without_tokens_it_binds_beyond_loopback_only_when_insecure(tmp_path: Path) -> None:
    refused = subprocess.run(
        codegym_command(["console", "--target", NOWHERE, "--host", "0.0.0.0", "--port", "0"]),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "insecure" in refused.stderr.lower(), refused.stderr
    console = CodegymServer(
        ["console", "--target", NOWHERE, "--host", "0.0.0.0", "--port", "0", "--insecure"], env=ENV
    )
    try:
        port = console.address.rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/live", timeout=10) as live:
            assert live.status == 200
    finally:
        assert console.stop() == 0


@pytest.mark.jail  # codegym up starts a sandbox worker
def test_codegym_up_console_port_serves_the_pages_behind_the_printed_trainer_token(tmp_path: Path) -> None:
    """`up --auth --console-port 0` prints the console's URL; it sends a visitor without a login to
    sign in, takes the printed trainer token, and serves the library from up's runtime."""
    args = ["up", "--auth", "--library", str(tmp_path / "lib.db"), "--port", "0", "--workers", "1"]
    up = CodegymServer([*args, "--jails", "1", "--no-record", "--console-port", "0"], env=ENV, timeout=120)
    try:
        wait_until(lambda: "Ctrl-C stops everything" in up.text, 60, "codegym up's addresses")
        trainer = re.search(rf"export {TOKEN_ENV}=(\S+)", up.text)
        url = re.search(r"  console: (http://\S+)/", up.text)
        assert trainer is not None and url is not None, up.text
        opener = urllib.request.build_opener(NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as first:
            opener.open(f"{url.group(1)}/library", timeout=10)
        assert first.value.code == 303 and first.value.headers["Location"].startswith("/login")
        body = urllib.parse.urlencode({"token": trainer.group(1)}).encode()
        with pytest.raises(urllib.error.HTTPError) as signed:
            opener.open(urllib.request.Request(f"{url.group(1)}/login", data=body), timeout=10)
        cookie = signed.value.headers["Set-Cookie"].split(";", 1)[0]
        page = urllib.request.Request(f"{url.group(1)}/library", headers={"Cookie": cookie})
        with urllib.request.urlopen(page, timeout=30) as answer:
            html = answer.read().decode()
        assert "Sample_0006_I__ArrayGcdEnv" in html and "trainer" in html
    finally:
        assert up.stop() == 0, up.text[-3000:]
