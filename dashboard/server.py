"""Serving the dashboard to a team: a Bokeh/Panel server with a login in front of every page.

``serve(source, credentials=...)`` runs ``dashboard.app.build_app`` per browser session. Every
application route (the page, its ``/ws`` websocket, ``autoload.js``) requires the signed ``user``
cookie that ``/login`` sets after checking a user name and password (Panel's
``BasicAuthProvider`` flow with our own login handler: constant-time comparison, a one-second
delay after a failed attempt, a self-contained login page that needs no CDN). Unauthenticated
requests are redirected to ``/login``; websockets without the cookie are refused. Websocket
origins are limited to the served address (plus ``allow_origins``), so another site cannot use a
logged-in browser's cookie.

``Credentials`` come from a JSON file ``{"user": "password", ...}`` (mode 0600, refused if
others can read it), or ``VARUNA_DASHBOARD_PASSWORD`` (user ``VARUNA_DASHBOARD_USER``, default
``varuna``), or are generated once into ``RUN_DIR/dashboard-credentials.json`` (0600). Passwords
are never printed or logged: ``repr(Credentials)`` shows user names only.

Imports panel/tornado and ``dashboard.app``; never imports torch or anything that drives a job.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import secrets
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import jinja2

from .store import resolve_event_log

ENV_PASSWORD = "VARUNA_DASHBOARD_PASSWORD"
ENV_USER = "VARUNA_DASHBOARD_USER"
DEFAULT_USER = "varuna"
CREDENTIALS_FILE = "dashboard-credentials.json"
FAILED_LOGIN_DELAY_S = 1.0

_env = jinja2.Environment(autoescape=True)
LOGIN_PAGE = _env.from_string("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>varuna dashboard · sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; background: #f3f5f8;
        color: #1d2330; display: flex; align-items: center; justify-content: center; height: 100vh; margin: 0; }
 form { background: white; border: 1px solid #dde1e6; border-radius: 10px; padding: 28px 32px; width: 300px; }
 h1 { font-size: 19px; margin: 0 0 4px 0; } p { color: #5f6b7a; font-size: 13px; margin: 0 0 18px 0; }
 label { display: block; font-size: 12px; color: #5f6b7a; margin: 10px 0 3px 0; }
 input { width: 100%; box-sizing: border-box; padding: 8px; font-size: 14px; border: 1px solid #c5ccd5;
         border-radius: 6px; }
 button { margin-top: 18px; width: 100%; padding: 9px; font-size: 14px; background: #2b5d9b; color: white;
          border: 0; border-radius: 6px; cursor: pointer; }
 .err { color: #b71c1c; font-size: 13px; margin-top: 10px; }
</style></head>
<body><form action="{{ login_endpoint }}" method="post" id="login">
<h1>varuna · team dashboard</h1><p>Read-only view of a training job. Sign in to continue.</p>
<label for="username">User</label><input id="username" name="username" autocomplete="username" autofocus>
<label for="password">Password</label><input id="password" name="password" type="password"
 autocomplete="current-password">
<button type="submit" id="submit">Sign in</button>
{% if errormessage %}<div class="err" id="error">{{ errormessage }}</div>{% endif %}
</form></body></html>""")
LOGOUT_PAGE = _env.from_string("""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">
<title>varuna dashboard · signed out</title></head>
<body style="font-family: system-ui, sans-serif; background:#f3f5f8; padding:40px">
<p>Signed out. <a href="{{ LOGIN_ENDPOINT }}">Sign in again</a></p></body></html>""")


@dataclass(frozen=True)
class Credentials:
    """User names and passwords allowed to sign in. ``repr`` shows the user names only."""

    users: Mapping[str, str] = field(repr=False)

    def __post_init__(self):
        if not self.users:
            raise ValueError("credentials need at least one user")
        for u, p in self.users.items():
            if not isinstance(u, str) or not u or not isinstance(p, str) or len(p) < 8:
                raise ValueError(f"user {u!r}: user names must be non-empty strings and passwords strings of at "
                                 "least 8 characters")

    def __repr__(self) -> str:
        return f"Credentials(users={sorted(self.users)})"

    def check(self, user: str, password: str) -> bool:
        """Whether ``user`` may sign in with ``password`` (constant-time comparison)."""
        expected = self.users.get(user)
        ok = hmac.compare_digest((expected or "\0").encode(), (password or "").encode())
        return expected is not None and ok

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Credentials | None":
        """From ``VARUNA_DASHBOARD_PASSWORD`` (and ``VARUNA_DASHBOARD_USER``); ``None`` if unset."""
        env = os.environ if env is None else env
        pw = env.get(ENV_PASSWORD)
        if not pw:
            return None
        return cls({env.get(ENV_USER) or DEFAULT_USER: pw})

    @classmethod
    def from_file(cls, path: str | Path) -> "Credentials":
        """From a JSON file ``{"user": "password", ...}`` that only its owner may read.

        Raises ``FileNotFoundError``, ``PermissionError`` (group/others can read it: run
        ``chmod 600 FILE``) or ``ValueError`` (not a JSON object of strings)."""
        p = Path(path)
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"credentials file {p} can be read by other users (mode {stat.filemode(mode)}); "
                                  f"run `chmod 600 {p}`")
        try:
            doc = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"credentials file {p} is not JSON ({e.msg} at line {e.lineno}); write "
                             '{"user": "password"}') from None
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise ValueError(f'credentials file {p} must hold a JSON object {{"user": "password", ...}}')
        return cls(dict(doc))

    @classmethod
    def generate(cls, path: str | Path, user: str = DEFAULT_USER) -> "Credentials":
        """A random password for ``user``, written to ``path`` (JSON, mode 0600) for the team to share."""
        creds = cls({user: secrets.token_urlsafe(18)})
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(creds.users), f)
        os.replace(tmp, p)
        return creds


def load_credentials(source: str | Path, credentials_file: str | Path | None = None,
                     env: Mapping[str, str] | None = None) -> tuple[Credentials, str]:
    """The credentials to serve ``source`` with, and where they came from (for the user; never
    the password): ``credentials_file``, else the environment, else ``dashboard-credentials.json``
    next to the event log (created with a random password on first use)."""
    if credentials_file is not None:
        return Credentials.from_file(credentials_file), f"users from {credentials_file}"
    c = Credentials.from_env(env)
    if c is not None:
        return c, f"user {next(iter(c.users))!r}, password from ${ENV_PASSWORD}"
    path = resolve_event_log(source).parent / CREDENTIALS_FILE
    if path.is_file():
        c = Credentials.from_file(path)
        return c, f"users from {path}"
    c = Credentials.generate(path)
    return c, f"user {DEFAULT_USER!r}, password generated into {path} (mode 0600)"


def _login_classes(credentials: Credentials):
    """The Panel auth provider class bound to ``credentials`` (imports panel lazily)."""
    from panel.auth import BasicAuthProvider, BasicLoginHandler, LogoutHandler

    class LoginHandler(BasicLoginHandler):
        _login_template = LOGIN_PAGE

        def _validate(self, username, password):
            return credentials.check(username, password)

        async def post(self):
            if self._validate(self.get_argument("username", ""), self.get_argument("password", "")):
                return super().post()  # validates again (cheap), sets the cookie, redirects
            await asyncio.sleep(FAILED_LOGIN_DELAY_S)  # slows password guessing
            self.redirect(self._login_endpoint + "?error=" + "Invalid%20user%20name%20or%20password")

    class Logout(LogoutHandler):
        _logout_template = LOGOUT_PAGE

    class Provider(BasicAuthProvider):
        def __init__(self):
            super().__init__()
            self._login_template = LOGIN_PAGE
            self._logout_template = LOGOUT_PAGE

        @property
        def login_handler(self):
            LoginHandler._login_endpoint = self._login_endpoint
            return LoginHandler

        @property
        def logout_handler(self):
            Logout._login_endpoint = self._login_endpoint
            return Logout

    return Provider


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def default_origins(address: str, port: int) -> list[str]:
    """Websocket origins a browser may load the page from: the served address, ``localhost`` for a
    loopback address, and this machine's host names for a wildcard address."""
    out = [f"{address}:{port}"]
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        ip = None
    if ip is not None and ip.is_loopback:
        out += [f"localhost:{port}", f"127.0.0.1:{port}"]
    if ip is not None and ip.is_unspecified:
        out += [f"{h}:{port}" for h in {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}]
    return sorted(set(out))


def serve(source: str | Path, *, credentials: Credentials, port: int = 0, address: str = "127.0.0.1",
          allow_origins: list[str] | None = None, job_id: str | None = None, refresh_s: float = 1.0,
          max_points: int = 2000, threaded: bool = False, start: bool = True):
    """Serve the dashboard of ``source`` (run folder or ``events.db``) at ``http://address:port/``
    behind a login with ``credentials``. ``port=0`` picks a free port. ``threaded=True``: returns a
    running ``StoppableThread`` at once (``.stop()`` ends it). Otherwise returns the Bokeh
    ``Server`` (``.port``, ``.start()``, ``.io_loop``), after blocking in its loop until Ctrl-C
    when ``start``. The whole history is read before the port opens (a 100k-step log: ~1 s).

    Raises ``FileNotFoundError`` when there is no event log at ``source`` yet, ``ValueError`` for
    bad arguments — before anything listens.
    """
    import panel as pn

    from .app import build_app

    resolve_event_log(source)  # fail before listening
    if not isinstance(credentials, Credentials):
        raise ValueError("credentials must be a dashboard.Credentials (a team dashboard always requires a login)")
    if refresh_s <= 0:
        raise ValueError(f"refresh_s must be > 0 seconds, got {refresh_s}")
    port = port or free_port(address if address not in ("", "0.0.0.0") else "127.0.0.1")
    origins = default_origins(address, port) + list(allow_origins or [])

    from .store import TelemetryStore

    TelemetryStore.shared(source, job_id).refresh(force=True)  # read the history now, not in the first viewer's wait

    def app():
        return build_app(source, job_id=job_id, refresh_s=refresh_s, max_points=max_points)

    return pn.serve({"/": app}, port=port, address=address, show=False, start=start, threaded=threaded,
                    title="varuna dashboard", websocket_origin=origins, verbose=False,
                    auth_provider=_login_classes(credentials)(), cookie_secret=secrets.token_urlsafe(32))
