"""Serving the dashboard to a team: a Bokeh/Panel server with a login in front of every page.

``serve(source, credentials=...)`` runs ``dashboard.app.build_app`` per browser session. Every
application route (the page, its ``/ws`` websocket, ``autoload.js``) requires the signed ``user``
cookie that ``/login`` sets after checking a user name and password (Panel's
``BasicAuthProvider`` flow with our own login handler: constant-time comparison, a one-second
delay after a failed attempt, a self-contained login page that needs no CDN). Unauthenticated
requests are redirected to ``/login``; websockets without the cookie are refused. Websocket
origins are limited to the served address (plus ``allow_origins``), so another site cannot use a
logged-in browser's cookie.

Sessions live on the server (``Sessions``): the cookie holds a random session id, not the user
name, so ``/logout`` revokes it at once and every session expires (``SESSION_TTL_S``, 12 h).
Cookies are ``HttpOnly`` and ``SameSite=Strict``, and ``Secure`` when served over TLS
(``certfile``/``keyfile``). Login attempts are throttled (``LoginThrottle``: per client address
and overall; over the limit the answer is ``429`` without checking the password), and every
failed attempt is logged with the user name and address, never the password. Passwords must have
at least ``MIN_PASSWORD_LENGTH`` characters of ``MIN_DISTINCT_CHARS`` different ones. The
framework's component-resource route serves only the packages the app uses (``panel``,
``bokeh``), to signed-in users: it never imports another module on a request.

``Credentials`` come from a JSON file ``{"user": "password", ...}`` (mode 0600, refused if
others can read it), or ``VARUNA_DASHBOARD_PASSWORD`` (user ``VARUNA_DASHBOARD_USER``, default
``varuna``), or are generated once into ``RUN_DIR/dashboard-credentials.json`` (0600). Passwords
are never printed or logged: ``repr(Credentials)`` shows user names only.

Imports panel/tornado and ``dashboard.app``; never imports torch or anything that drives a job.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import html
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
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
MIN_PASSWORD_LENGTH = 12
MIN_DISTINCT_CHARS = 6
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 10_000
COMPONENT_PACKAGES = ("panel", "bokeh")   # what the app's components come from

log = logging.getLogger(__name__)

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
            if not isinstance(u, str) or not u or len(u) > 64 or not isinstance(p, str):
                raise ValueError(f"user {str(u)[:64]!r}: user names must be strings of 1-64 characters and "
                                 "passwords strings")
            if len(p) < MIN_PASSWORD_LENGTH or len(set(p)) < MIN_DISTINCT_CHARS:
                raise ValueError(f"user {u!r}: the password is too weak: use at least {MIN_PASSWORD_LENGTH} "
                                 f"characters with at least {MIN_DISTINCT_CHARS} different ones (a passphrase, or "
                                 "leave it out and a random one is generated)")

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
    next to the event log, or in the folder of runs (created with a random password on first use)."""
    if credentials_file is not None:
        return Credentials.from_file(credentials_file), f"users from {credentials_file}"
    c = Credentials.from_env(env)
    if c is not None:
        return c, f"user {next(iter(c.users))!r}, password from ${ENV_PASSWORD}"
    path = (Path(source).expanduser() if is_folder_of_runs(source) else resolve_event_log(source).parent) / CREDENTIALS_FILE
    if path.is_file():
        c = Credentials.from_file(path)
        return c, f"users from {path}"
    c = Credentials.generate(path)
    return c, f"user {DEFAULT_USER!r}, password generated into {path} (mode 0600)"


class Sessions:
    """Server-side login sessions: ``{random id: (user, expires at)}``. Thread-safe. The cookie
    holds only the id, so ``revoke`` (logout) ends a session at once and ``ttl_s`` bounds every
    session's life; at most ``max_sessions`` are kept (the oldest go first)."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS):
        self.ttl_s, self.max_sessions = float(ttl_s), int(max_sessions)
        self._by_id: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def create(self, user: str) -> str:
        """Open a session for ``user`` (already authenticated) that expires ``ttl_s`` seconds from now and return its
        new random id (what the signed cookie holds). Beyond ``max_sessions`` the oldest sessions are dropped."""
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._by_id[sid] = (user, time.monotonic() + self.ttl_s)
            while len(self._by_id) > self.max_sessions:
                self._by_id.popitem(last=False)
        return sid

    def user(self, sid: str | None) -> str | None:
        """The user of a live session ``sid`` (None: unknown, revoked or expired)."""
        if not sid:
            return None
        with self._lock:
            entry = self._by_id.get(sid)
            if entry is None:
                return None
            if time.monotonic() >= entry[1]:
                del self._by_id[sid]
                return None
            return entry[0]

    def revoke(self, sid: str | None) -> None:
        """End session ``sid`` at once (logout); an unknown, expired or None id is ignored."""
        with self._lock:
            self._by_id.pop(sid or "", None)

    def __len__(self) -> int:
        return len(self._by_id)


class LoginThrottle:
    """Bounds password guessing: at most ``per_client`` failed attempts per ``window_s`` from one
    client address and ``overall`` from all of them; ``allowed(addr)`` says whether an attempt may
    be checked now (else answer ``429``), ``failed(addr)`` counts one. Thread-safe."""

    def __init__(self, per_client: int = 5, overall: int = 50, window_s: float = 60.0):
        self.per_client, self.overall, self.window_s = per_client, overall, window_s
        self._fails: dict[str, collections.deque] = {}
        self._all: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def _trim(self, q: collections.deque, now: float) -> None:
        while q and now - q[0] >= self.window_s:
            q.popleft()

    def allowed(self, addr: str) -> tuple[bool, float]:
        """(may this attempt be checked, seconds until it may be when not)."""
        now = time.monotonic()
        with self._lock:
            q = self._fails.get(addr)
            if q is not None:
                self._trim(q, now)
            self._trim(self._all, now)
            if q is not None and len(q) >= self.per_client:
                return False, self.window_s - (now - q[0])
            if len(self._all) >= self.overall:
                return False, self.window_s - (now - self._all[0])
            return True, 0.0

    def failed(self, addr: str) -> None:
        """Count one failed login attempt from client address ``addr``, against both its own limit and the overall one,
        for the next ``window_s`` seconds."""
        now = time.monotonic()
        with self._lock:
            if len(self._fails) > 10_000:   # bounded memory under a flood of addresses
                self._fails = {a: q for a, q in self._fails.items() if q and now - q[-1] < self.window_s}
            self._fails.setdefault(addr, collections.deque()).append(now)
            self._all.append(now)


def _session_id(handler) -> str | None:
    """The server-side session id in ``handler``'s signed ``user`` cookie (None: none, or not ASCII)."""
    raw = handler.get_secure_cookie("user", max_age_days=max(1, SESSION_TTL_S / 86400))
    try:
        return raw.decode("ascii") if raw else None
    except UnicodeDecodeError:
        return None


def _login_handler_class(credentials: Credentials, sessions: Sessions, throttle: LoginThrottle,
                         cookie_flags: dict):
    """Panel's login page handler bound to ``credentials``: refuses a throttled address (HTTP 429
    with ``Retry-After``), slows a failed sign-in by ``FAILED_LOGIN_DELAY_S`` seconds, and on
    success puts a new server-side session id (never the user name) in the cookie."""
    from panel.auth import BasicLoginHandler
    from panel.config import config as pn_config

    class LoginHandler(BasicLoginHandler):
        _login_template = LOGIN_PAGE

        def _validate(self, username, password):
            return credentials.check(username, password)

        async def post(self):
            addr = self.request.remote_ip or "?"
            ok, wait_s = throttle.allowed(addr)
            user = self.get_argument("username", "")[:64]
            if not ok:
                log.warning("dashboard login from %s refused: too many failed attempts (retry in %.0f s)", addr, wait_s)
                self.set_status(429)
                self.set_header("Retry-After", str(max(1, int(wait_s + 0.999))))
                self.write("Too many failed sign-in attempts; try again later.")
                return
            if self._validate(user, self.get_argument("password", "")):
                log.info("dashboard login: user %r from %s", user, addr)
                self.set_current_user(user)
                self.redirect(_validated_next(self))
                return
            throttle.failed(addr)
            log.warning("dashboard login failed: user %r from %s", user, addr)
            await asyncio.sleep(FAILED_LOGIN_DELAY_S)  # slows password guessing
            self.redirect(self._login_endpoint + "?error=" + "Invalid%20user%20name%20or%20password")

        def set_current_user(self, user):
            self.clear_cookie("is_guest")
            self.set_secure_cookie("user", sessions.create(user), expires_days=SESSION_TTL_S / 86400,
                                   path=pn_config.cookie_path, **cookie_flags)

        def set_secure_cookie(self, name, value, expires_days=30, version=None, **kwargs):
            return super().set_secure_cookie(name, value, expires_days, version, **{**kwargs, **cookie_flags})

    return LoginHandler


def _login_classes(credentials: Credentials, *, tls: bool = False, sessions: Sessions | None = None,
                   throttle: LoginThrottle | None = None):
    """The Panel auth provider class bound to ``credentials`` (imports panel lazily), with
    server-side ``sessions`` and a login ``throttle``; cookies ``Secure`` when ``tls``."""
    from panel.auth import BasicAuthProvider, LogoutHandler

    sessions = Sessions() if sessions is None else sessions      # (an empty table is falsy)
    throttle = LoginThrottle() if throttle is None else throttle
    cookie_flags = {"httponly": True, "samesite": "Strict", "secure": tls}
    LoginHandler = _login_handler_class(credentials, sessions, throttle, cookie_flags)

    class Logout(LogoutHandler):
        _logout_template = LOGOUT_PAGE

        def get(self):
            sessions.revoke(_session_id(self))
            super().get()

    class Provider(BasicAuthProvider):
        def __init__(self):
            super().__init__()
            self._login_template = LOGIN_PAGE
            self._logout_template = LOGOUT_PAGE
            self.sessions, self.throttle = sessions, throttle

        def _remove_user(self, session_context):  # panel's active-user count keys on names we do not put in cookies
            return None

        @property
        def get_user(self):
            def get_user(request_handler):
                return sessions.user(_session_id(request_handler))
            return get_user

        @property
        def login_handler(self):
            LoginHandler._login_endpoint = self._login_endpoint
            return LoginHandler

        @property
        def logout_handler(self):
            Logout._login_endpoint = self._login_endpoint
            return Logout

    return Provider


def _validated_next(handler) -> str:
    """Where to go after signing in: the ``next_url`` cookie if it is a path on this server."""
    nxt = handler.get_cookie("next_url", "/") or "/"
    handler.clear_cookie("next_url")
    return nxt if nxt.startswith("/") and not nxt.startswith("//") and "\\" not in nxt else "/"


def _component_handler(get_user):
    """Panel's component-resource route, limited to ``COMPONENT_PACKAGES`` and signed-in users: it
    resolves the module named in the URL, and the framework's own would import any installed one."""
    from panel.io.server import ComponentResourceHandler
    from tornado.web import HTTPError

    class LimitedComponentResources(ComponentResourceHandler):
        def get_current_user(self):
            return get_user(self)

        def parse_url_path(self, path: str) -> str:
            if self.current_user is None:
                raise HTTPError(403, "sign in first")
            module = path.split("/", 1)[0]
            if module.split(".", 1)[0] not in COMPONENT_PACKAGES:
                raise HTTPError(404, "Module not found")
            return super().parse_url_path(path)

    return LimitedComponentResources


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


def _quiet_closed_tabs() -> None:
    """A closed browser tab is not an error: Bokeh's "Failed sending message as connection was
    closed" warnings and Tornado's never-retrieved ``WebSocketClosedError``/``StreamClosedError``
    tasks are silenced in the server's event loop (called from each session, on that loop); every
    other exception still goes to the loop's default handler."""
    from tornado.iostream import StreamClosedError
    from tornado.websocket import WebSocketClosedError

    logging.getLogger("bokeh.server.views.ws").setLevel(logging.ERROR)
    loop = asyncio.get_event_loop()
    if getattr(loop, "_varuna_quiet", False):
        return

    def handler(lp, context) -> None:
        if isinstance(context.get("exception"), (WebSocketClosedError, StreamClosedError)):
            return
        lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
    loop._varuna_quiet = True  # type: ignore[attr-defined]


def _stop_with_the_session(view) -> None:
    """Stop a view's periodic refresh when its browser session ends (tab closed)."""
    import panel as pn

    dash = getattr(view, "dashboard", None)
    cb = getattr(view, "callback", None)
    try:
        pn.state.on_session_destroyed(lambda ctx: (dash.stop() if dash is not None else None,
                                                   cb.stop() if cb is not None else None))
    except Exception:  # noqa: BLE001 - outside a served session (a notebook): nothing to tie it to
        pass


def is_folder_of_runs(source: str | Path) -> bool:
    """``source`` is a folder that holds runs (or will), not one run folder or event-log file."""
    p = Path(source).expanduser()
    return p.is_dir() and not (p / "events.db").exists()


def _job_routes(root: Path, *, job_id: str | None, refresh_s: float, max_points: int) -> dict:
    """The routes of a folder of runs: ``/`` the jobs page, ``/job?run=NAME`` one job's dashboard
    (only a run folder directly inside ``root``: ``jobs.run_folder``)."""
    import panel as pn

    from .app import build_app
    from .theme import CSS
    from .jobs import build_jobs_app, run_folder

    def jobs():
        _quiet_closed_tabs()
        view = build_jobs_app(root, refresh_s=max(refresh_s, 1.0))
        _stop_with_the_session(view)
        return view

    def job():
        _quiet_closed_tabs()
        raw = (pn.state.session_args.get("run") or [b""])[0]
        name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        back = pn.pane.HTML('<a href="./">← all jobs</a>', stylesheets=[CSS], margin=(6, 10, 0, 10))
        try:
            folder = run_folder(root, name)
        except FileNotFoundError:
            return pn.Column(back, pn.pane.HTML(f"<p>No run named {html.escape(name)!s} in this folder.</p>",
                                                stylesheets=[CSS]))
        view = build_app(folder, job_id=job_id, refresh_s=refresh_s, max_points=max_points)
        _stop_with_the_session(view)
        return pn.Column(back, view, sizing_mode="stretch_width", margin=0)

    return {"/": jobs, "/job": job}


def serve(source: str | Path, *, credentials: Credentials, port: int = 0, address: str = "127.0.0.1",
          allow_origins: list[str] | None = None, job_id: str | None = None, refresh_s: float = 1.0,
          max_points: int = 2000, threaded: bool = False, start: bool = True,
          certfile: str | Path | None = None, keyfile: str | Path | None = None,
          throttle: LoginThrottle | None = None, sessions: Sessions | None = None):
    """Serve the dashboard of ``source`` (run folder or ``events.db``) at ``http://address:port/``
    behind a login with ``credentials``; for a folder of runs, the jobs page at ``/`` and each job's
    dashboard at ``/job?run=NAME``. ``port=0`` picks a free port. ``threaded=True``: returns a
    running ``StoppableThread`` at once (``.stop()`` ends it). Otherwise returns the Bokeh
    ``Server`` (``.port``, ``.start()``, ``.io_loop``), after blocking in its loop until Ctrl-C
    when ``start``. The whole history is read before the port opens (a 100k-step log: ~1 s).
    ``certfile``/``keyfile``: serve HTTPS (PEM files) with ``Secure`` cookies. ``throttle``,
    ``sessions``: the login throttle and session table (defaults: ``LoginThrottle()``, ``Sessions()``).

    Raises ``FileNotFoundError`` when there is no event log at ``source`` yet, ``ValueError`` for
    bad arguments — before anything listens.
    """
    import panel as pn

    from .app import build_app

    many = is_folder_of_runs(source)
    if not many:
        resolve_event_log(source)  # fail before listening
    if not isinstance(credentials, Credentials):
        raise ValueError("credentials must be a dashboard.Credentials (a team dashboard always requires a login)")
    if not (isinstance(refresh_s, (int, float)) and 0 < refresh_s <= 3600):
        raise ValueError(f"refresh_s must be between 0 and 3600 seconds, got {refresh_s}")
    if (certfile is None) != (keyfile is None):
        raise ValueError("TLS needs both certfile and keyfile (PEM files), or neither")
    tls = {}
    if certfile is not None:
        for what, f in (("certfile", certfile), ("keyfile", keyfile)):
            if not Path(f).is_file():
                raise FileNotFoundError(f"{what} {f} does not exist")
        import ssl

        try:  # fail before listening, with the file named
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(certfile), str(keyfile))
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"cannot use certfile {certfile} with keyfile {keyfile}: {e}") from None
        tls = {"ssl_certfile": str(certfile), "ssl_keyfile": str(keyfile)}
    port = port or free_port(address if address not in ("", "0.0.0.0") else "127.0.0.1")
    origins = default_origins(address, port) + list(allow_origins or [])

    from .store import TelemetryStore

    if many:
        routes = _job_routes(Path(source), job_id=job_id, refresh_s=refresh_s, max_points=max_points)
    else:
        TelemetryStore.shared(source, job_id).refresh(force=True)  # read the history now, not in the first viewer's wait

        def app():
            _quiet_closed_tabs()
            view = build_app(source, job_id=job_id, refresh_s=refresh_s, max_points=max_points)
            _stop_with_the_session(view)
            return view

        routes = {"/": app}
    provider = _login_classes(credentials, tls=bool(tls), sessions=sessions, throttle=throttle)()
    components = (r"/components/(.*)", _component_handler(provider.get_user), {})
    return pn.serve(routes, port=port, address=address, show=False, start=start, threaded=threaded,
                    title="varuna dashboard", websocket_origin=origins, verbose=False,
                    auth_provider=provider, cookie_secret=secrets.token_urlsafe(32),
                    extra_patterns=[components], **tls)
