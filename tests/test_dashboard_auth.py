"""The dashboard's login against guessing, stolen cookies and nosy requests (a real Panel server
over real HTTP and HTTPS on loopback).

Shown: failed logins are throttled per client (``429`` with ``Retry-After``, the password not even
checked) and logged with the user and address but never the password; the session cookie is
``HttpOnly`` and ``SameSite=Strict`` and names a server-side session that ``/logout`` revokes (the
same cookie no longer opens the page) and that expires; over TLS the cookie is ``Secure``; the
component-resource route imports no module outside the app's packages, signed in or not.
"""

from __future__ import annotations

import datetime
import http.client
import logging
import secrets
import socket
import ssl
import sys
import time

import pytest

from dashboard.server import Credentials, LoginThrottle, Sessions, serve
from varuna_sdk.manager.events import EventLog

pytestmark = pytest.mark.timeout(120)
USER = "ann"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run(tmp_path):
    log = EventLog(tmp_path / "events.db")
    log.append("job_started", job_id="j", payload={"P": 1, "D": 1})
    log.close()
    return tmp_path


def _conn(port: int, tls: bool = False):
    if tls:
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=20, context=ssl._create_unverified_context())
    return http.client.HTTPConnection("127.0.0.1", port, timeout=20)


def _wait(port: int, tls: bool = False) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            c = _conn(port, tls)
            c.request("GET", "/login")
            if c.getresponse().status == 200:
                return
        except (OSError, ssl.SSLError):
            time.sleep(0.2)
    raise AssertionError("dashboard did not answer")


def _post_login(port: int, password: str, tls: bool = False):
    c = _conn(port, tls)
    c.request("POST", "/login", body=f"username={USER}&password={password}",
              headers={"Content-Type": "application/x-www-form-urlencoded"})
    r = c.getresponse()
    r.read()
    return r


def _get(port: int, path: str, cookie: str = "", tls: bool = False):
    c = _conn(port, tls)
    c.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    r = c.getresponse()
    return r, r.read().decode(errors="replace")


@pytest.fixture
def dashboard(run):
    password = secrets.token_urlsafe(16)
    port = _free_port()
    sessions = Sessions(ttl_s=3600)
    srv = serve(run, credentials=Credentials({USER: password}), port=port, threaded=True,
                throttle=LoginThrottle(per_client=3, overall=50, window_s=60), sessions=sessions)
    try:
        _wait(port)
        yield port, password, sessions
    finally:
        srv.stop()


def test_guessing_is_throttled_and_logged_without_the_password(dashboard, caplog):
    caplog.set_level(logging.INFO, logger="dashboard.server")
    port, password, _ = dashboard
    for i in range(3):
        r = _post_login(port, f"guess-number-{i}")
        assert r.status in (302, 303) and "error=" in r.getheader("Location", "")
    r = _post_login(port, password)            # the right password, but over the limit: not checked
    assert r.status == 429 and int(r.getheader("Retry-After")) >= 1
    assert "user=" not in (r.getheader("Set-Cookie") or "")
    failed = [rec.getMessage() for rec in caplog.records if "login failed" in rec.getMessage()]
    assert len(failed) == 3 and all(f"user '{USER}' from 127.0.0.1" in m for m in failed), failed
    assert not any("guess-number" in rec.getMessage() or password in rec.getMessage() for rec in caplog.records)
    assert any("too many failed attempts" in rec.getMessage() for rec in caplog.records)


def test_logout_revokes_the_session_cookie(dashboard):
    port, password, sessions = dashboard
    r = _post_login(port, password)
    assert r.status in (302, 303)
    raw = [v for k, v in r.getheaders() if k.lower() == "set-cookie" and v.startswith("user=")]
    assert raw and "SameSite=Strict" in raw[0] and "HttpOnly" in raw[0] and "Secure" not in raw[0], raw
    cookie = raw[0].split(";")[0]
    assert USER not in cookie.split("=", 1)[1].split("|")[0]   # the cookie holds a session id, not the name
    page, body = _get(port, "/", cookie)
    assert page.status == 200 and "Bokeh" in body and len(sessions) == 1
    out, _ = _get(port, "/logout", cookie)
    assert out.status == 200 and len(sessions) == 0
    again, body = _get(port, "/", cookie)       # the stolen / kept cookie is dead
    assert again.status in (302, 303) and "login" in again.getheader("Location", "") and "docs_json" not in body


def test_sessions_expire():
    s = Sessions(ttl_s=0.3, max_sessions=2)
    a = s.create("ann")
    assert s.user(a) == "ann" and s.user("forged") is None and s.user(None) is None
    time.sleep(0.35)
    assert s.user(a) is None
    b, c, d = s.create("b"), s.create("c"), s.create("d")
    assert s.user(b) is None and s.user(c) == "c" and s.user(d) == "d"   # bounded: the oldest went


def test_component_route_imports_nothing_outside_the_app(dashboard):
    port, password, _ = dashboard
    probe = "xml.dom.minidom"
    assert probe not in sys.modules
    r, _ = _get(port, f"/components/{probe}/Node/__css__/x.css")
    assert r.status == 403 and probe not in sys.modules                 # not signed in
    login = _post_login(port, password)
    cookie = next(v for k, v in login.getheaders() if k.lower() == "set-cookie" and v.startswith("user=")).split(";")[0]
    r, _ = _get(port, f"/components/{probe}/Node/__css__/x.css", cookie)
    assert r.status == 404 and probe not in sys.modules                 # signed in: still not imported


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


def test_tls_serves_https_with_secure_cookies(run, tmp_path):
    certfile, keyfile = _self_signed(tmp_path)
    password = secrets.token_urlsafe(16)
    port = _free_port()
    srv = serve(run, credentials=Credentials({USER: password}), port=port, threaded=True, certfile=certfile,
                keyfile=keyfile)
    try:
        _wait(port, tls=True)
        r = _post_login(port, password, tls=True)
        raw = [v for k, v in r.getheaders() if k.lower() == "set-cookie" and v.startswith("user=")]
        assert raw and "Secure" in raw[0] and "SameSite=Strict" in raw[0], raw
        page, body = _get(port, "/", raw[0].split(";")[0], tls=True)
        assert page.status == 200 and "Bokeh" in body
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException, OSError)):
            _get(port, "/login")                                           # plain HTTP is not served
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="both certfile and keyfile"):
        serve(run, credentials=Credentials({USER: password}), certfile=certfile, start=False)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ValueError, match="cannot use certfile"):
        serve(run, credentials=Credentials({USER: password}), certfile=bad, keyfile=keyfile, start=False)
