"""What the page for tenants and finance (routes/ui.py) is made of besides its routes: the Jinja2
templates shipped in templates/ui (autoescaped), the credential kept in a cookie, the CSRF token
of its two forms, and the geometry of a burn-down chart (drawn as inline SVG by the template).

CSRF: the sign-in and sign-out forms use a double-submit token. The first page served sets a
random token in an HttpOnly, SameSite=Strict cookie and the form carries the same value in a
hidden field; a POST is refused (403) unless both are present and equal, and, when the browser
sends an Origin header, unless it names this very host. Nothing else on the page changes state."""

from __future__ import annotations

import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from budgetgate.core.units import Unit
from budgetgate.core.windows import rfc3339
from budgetgate.reports.burndown import BurnDown

TOKEN_COOKIE = "budgetgate_ui_token"
CSRF_COOKIE = "budgetgate_ui_csrf"
COOKIE_PATH = "/ui"
# The longest credential the sign-in form takes (an OIDC JWT with many claims stays well under it).
MAX_TOKEN_CHARS = 8192
# Printable ASCII without spaces: what a bearer credential is made of (RFC 6750's b64token and more).
_CREDENTIAL = re.compile(r"[\x21-\x7e]+")
# Where sign-in may send the reader back to: a path of the page, nothing else (no other host).
_NEXT = re.compile(r"/ui(?:/[A-Za-z0-9._~/%:@+-]*)?(?:\?[A-Za-z0-9._~%=&+-]*)?")
# No script, no frames, nothing fetched from elsewhere: the page is HTML, its own styles and inline SVG.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

templates = jinja2.Environment(
    loader=jinja2.PackageLoader("budgetgate.services.admission", "templates/ui"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


class BadForm(ValueError):
    """A sign-in or sign-out form that cannot be taken; `field` names the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def render(request: Request, name: str, *, status: int = 200, **context: Any) -> Response:
    """The page `name` with `context`, a CSRF token for its forms (set as a cookie when the
    reader has none) and headers that keep it out of caches and frames."""
    csrf = request.cookies.get(CSRF_COOKIE)
    fresh = csrf is None or not _CREDENTIAL.fullmatch(csrf) or len(csrf) > 128
    if fresh:
        csrf = secrets.token_urlsafe(32)
    body = templates.get_template(name).render(csrf=csrf, **context)
    response = Response(body, status_code=status, media_type="text/html; charset=utf-8", headers=page_headers())
    if fresh:
        set_cookie(request, response, CSRF_COOKIE, csrf)
    return response


def page_headers() -> dict[str, str]:
    return {"Cache-Control": "no-store", "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}


def set_cookie(request: Request, response: Response, name: str, value: str) -> None:
    """A cookie of the page's: HttpOnly, SameSite=Strict, Secure when the request came over HTTPS."""
    response.set_cookie(name, value, path=COOKIE_PATH, httponly=True, samesite="strict", secure=request.url.scheme == "https")


def clear_cookie(request: Request, response: Response, name: str) -> None:
    response.delete_cookie(name, path=COOKIE_PATH, httponly=True, samesite="strict", secure=request.url.scheme == "https")


async def form_of(request: Request) -> dict[str, str]:
    """The urlencoded form of a POST (one value a field), its CSRF token checked; raises BadForm."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise BadForm("content-type", f"the form must be sent as application/x-www-form-urlencoded, not {kind or 'nothing'!r}")
    try:
        fields = parse_qs((await request.body()).decode("utf-8"), keep_blank_values=True, strict_parsing=False, max_num_fields=8)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadForm("form", f"the form cannot be read: {exc}") from None
    form = {name: values[-1] for name, values in fields.items()}
    check_csrf(request, form.get("csrf"))
    return form


def check_csrf(request: Request, sent: str | None) -> None:
    """Double submit: the form's token equals the cookie's; and an Origin, when sent, is this host's."""
    origin = request.headers.get("origin")
    if origin is not None:
        host = request.headers.get("host", "")
        if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
            raise BadForm("csrf", f"csrf: the form was sent from another site ({origin}); send it from this page")
    kept = request.cookies.get(CSRF_COOKIE)
    if not sent or not kept or not hmac.compare_digest(sent.encode(), kept.encode()):
        raise BadForm("csrf", "csrf: the form's CSRF token is missing or does not match this browser's; reload the page and send it again")


def credential(text: str | None) -> str:
    """A pasted token, trimmed (and a `Bearer ` prefix dropped); raises BadForm naming `token`."""
    value = (text or "").strip()
    if value[:7].lower() == "bearer ":
        value = value[7:].strip()
    if not value:
        raise BadForm("token", "token: paste an API token (bg_…) or an OIDC token")
    if len(value) > MAX_TOKEN_CHARS:
        raise BadForm("token", f"token: {len(value)} characters, more than the {MAX_TOKEN_CHARS} a token can have")
    if not _CREDENTIAL.fullmatch(value):
        raise BadForm("token", "token: a token is printable ASCII without spaces")
    return value


def next_path(value: str | None) -> str:
    """Where to go after signing in: a path of the page, else the page itself."""
    return value if value and _NEXT.fullmatch(value) and "//" not in value else "/ui"


# The chart's box, in SVG user units; the plot sits inside the margins.
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 560, 200, 64, 16, 16, 32


@dataclass(frozen=True)
class Chart:
    """A burn-down laid out for the template: every coordinate, and the sentence it says."""

    width: int
    height: int
    plot: tuple[float, float, float, float]  # left, top, right, bottom
    limit_y: float
    used: str  # SVG polyline points of consumption so far
    now: tuple[float, float]  # the ledger's consumed figure, now
    reserved: tuple[float, float, float]  # x, top y, height of the reserved bar on top of it
    projection: tuple[float, float, float, float]  # from now to the window's end
    top_label: str
    start_label: str
    end_label: str
    text: str


def chart(burn: BurnDown, unit_name: str) -> Chart:
    """The burn-down's geometry and its text alternative."""
    figures = burn.figures()
    scale = burn.unit.scale
    # The daily curve is the usage records' and need not end at the ledger's figure: room for both.
    highest = max((total for _, total in burn.daily or ()), default=0)
    top = max(burn.limit, burn.projected + burn.reserved, burn.consumed + burn.reserved, highest, 1) * 1.05
    length = (burn.end - burn.start).total_seconds()
    left, right, ceiling, floor = LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM

    def x(at: datetime) -> float:
        share = min(max((at - burn.start).total_seconds() / length, 0.0), 1.0)
        return round(left + (right - left) * share, 1)

    def y(amount: float) -> float:
        return round(floor - (floor - ceiling) * amount / top, 1)

    now = min(burn.now, burn.end)
    points = [(x(burn.start), y(0))]
    if burn.daily is None:  # no daily figures: the pace so far, as a straight line
        points.append((x(now), y(burn.consumed)))
    else:
        for day, total in burn.daily:
            points.append((x(min(day + timedelta(days=1), now)), y(total)))  # by the end of each day
        points.append((x(now), y(burn.daily[-1][1] if burn.daily else 0)))  # and flat since the last metered day
    used = " ".join(f"{px},{py}" for px, py in points)
    exhausted = figures["exhausted_at"]
    shown = {name: number(value, burn.unit) for name, value in figures.items() if isinstance(value, float)}
    text = (
        f"Used {shown['consumed']} of {shown['limit']} {unit_name} "
        f"({round(100 * burn.consumed / burn.limit, 1) if burn.limit else 0}%) between {rfc3339(burn.start)[:10]} and {rfc3339(now)[:16]}Z, "
        f"with {shown['reserved']} more reserved. At this pace it reaches {shown['projected']} by the window's end "
        f"({rfc3339(burn.end)[:10]}), {shown['projected_with_reserved']} with what is reserved"
        + (f"; the limit is reached around {exhausted[:16]}Z." if exhausted else "; the limit is not reached.")
    )
    return Chart(
        width=WIDTH,
        height=HEIGHT,
        plot=(left, ceiling, right, floor),
        limit_y=y(burn.limit),
        used=used,
        now=(x(now), y(burn.consumed)),
        reserved=(x(now), y(burn.consumed + burn.reserved), round(y(burn.consumed) - y(burn.consumed + burn.reserved), 1)),
        projection=(x(now), y(burn.consumed), x(burn.end), y(burn.projected)),
        top_label=f"{top / scale:,.1f}",
        start_label=rfc3339(burn.start)[:10],
        end_label=rfc3339(burn.end)[:10],
        text=text,
    )


def number(value: float, unit: Unit) -> str:
    """A figure as the page writes it: money to the cent, hours to the thousandth."""
    return f"{value:,.2f}" if unit is Unit.COST else f"{value:,.3f}"


UNIT_NAMES = {Unit.GPU_HOURS: "GPU-hours", Unit.NODE_HOURS: "node-hours", Unit.WALL_HOURS: "wall-hours", Unit.COST: ""}
