"""Refusing private-network targets while downloading a pool.

Metadata urls come from the open web: one that points at (or redirects to, or resolves to) a loopback,
private or link-local address would make the download a request forger against the machine's own
network, e.g. a cloud metadata service at 169.254.169.254. The check therefore runs where the socket
is opened: `install_guard` puts a urllib opener into the download worker whose connections resolve
the host once, refuse every blocked address and connect to a checked one (no second lookup that DNS
rebinding could answer differently). Redirects go through the same opener, so they are checked too.

Behind an HTTP(S) proxy the socket goes to the proxy, which resolves the target itself: then the
target host is resolved here and checked before the request is sent (best effort, the proxy could see
another answer). `scan_hosts` is the cheap up-front count of urls that are refused by their name alone
(IP literals, `localhost`).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

# Marker in every refusal message: img2dataset records str(error) per sample, the summary counts on it.
REFUSED = "refused private network target"
ALLOW_HINT = "pass --allow-private-network to download from it"


LOCAL_SCHEMES = ("file", "ftp", "data")


class PrivateNetworkRefused(OSError):
    def __init__(self, kind: str):
        kind = kind if kind.endswith(" url") else f"{kind} address"
        super().__init__(f"{REFUSED} ({kind}); {ALLOW_HINT}")
        self.kind = kind


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `ip` is not a public internet address (`loopback`, `link-local`, ...), or None if it is."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 reaches 127.0.0.1
    for kind, flag in (
        ("unspecified", ip.is_unspecified),  # 0.0.0.0 connects to the local host on Linux
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("private", ip.is_private),
        ("multicast", ip.is_multicast),
        ("reserved", ip.is_reserved),
        ("non-global", not ip.is_global),  # shared address space 100.64/10, documentation ranges, ...
    ):
        if flag:
            return kind
    return None


@dataclass(frozen=True)
class NetworkPolicy:
    """What download workers may connect to; pickled into every worker process."""

    allow_private: bool = False
    allowed_networks: tuple[str, ...] = ()  # CIDRs reachable even when private (e.g. an internal mirror)

    def refusal(self, address: str) -> str | None:
        """The kind of a refused address (an IP string as getaddrinfo returns it), or None if allowed."""
        if self.allow_private:
            return None
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
        kind = address_kind(ip)
        if kind is None:
            return None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        nets = (ipaddress.ip_network(n, strict=False) for n in self.allowed_networks)
        return None if any(ip.version == n.version and ip in n for n in nets) else kind

    def host_refusal(self, host: str) -> str | None:
        """Refusal by the name alone, without a DNS lookup: IP literals and `localhost` names."""
        if self.allow_private or not host:
            return None
        host = host.strip("[]").rstrip(".").lower()
        try:
            return self.refusal(host)
        except ValueError:
            pass  # a name, not an address
        if host == "localhost" or host.endswith(".localhost"):
            return self.refusal("127.0.0.1")
        return None

    def scheme_refusal(self, scheme: str) -> str | None:
        """urllib also opens file:, ftp: and data: urls: local files and unchecked connections."""
        if self.allow_private or scheme not in LOCAL_SCHEMES:
            return None
        return f"{scheme}: url"


def guarded_create_connection(address, timeout, source_address, policy: NetworkPolicy) -> socket.socket:
    """`socket.create_connection` that never connects to an address the policy refuses."""
    host, port = address
    error: OSError | None = None
    refused: str | None = None
    for family, socktype, proto, _, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        kind = policy.refusal(sockaddr[0])
        if kind is not None:
            refused = refused or kind
            continue
        sock = socket.socket(family, socktype, proto)
        try:
            if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:  # what socket.create_connection compares to
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            error = e
            sock.close()
    if error is not None:
        raise error
    if refused is not None:
        raise PrivateNetworkRefused(refused)
    raise OSError(f"getaddrinfo returned no address for {host!r}")


class _Guarded:
    """Mixin for http.client connections: the socket is opened by `guarded_create_connection`."""

    def __init__(self, *args, policy: NetworkPolicy, check_socket: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if check_socket:
            self._create_connection = lambda addr, timeout, src=None: guarded_create_connection(
                addr, timeout, src, policy
            )


class _GuardedHTTPConnection(_Guarded, http.client.HTTPConnection):
    pass


class _GuardedHTTPSConnection(_Guarded, http.client.HTTPSConnection):
    pass


def _connection(req: urllib.request.Request, cls: type, policy: NetworkPolicy):
    target = urlsplit(req.full_url).hostname or ""
    via_proxy = req.has_proxy() or getattr(req, "_tunnel_host", None)
    if via_proxy:
        # The socket goes to the proxy (often on a private address itself): check the target instead.
        try:
            infos = socket.getaddrinfo(target, None, 0, socket.SOCK_STREAM)
        except OSError:
            infos = []  # the proxy may resolve names this host cannot; only literals are checked then
        # which address the proxy picks is unknown: one refused address refuses the url
        kinds = [policy.refusal(info[4][0]) for info in infos] or [policy.host_refusal(target)]
        refused = [k for k in kinds if k is not None]
        if refused:
            raise urllib.error.URLError(PrivateNetworkRefused(refused[0]))  # as do_open wraps errors

    def factory(host, **kwargs):
        return cls(host, policy=policy, check_socket=not via_proxy, **kwargs)

    return factory


class _GuardedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, policy: NetworkPolicy):
        super().__init__()
        self.policy = policy

    def http_open(self, req):
        return self.do_open(_connection(req, _GuardedHTTPConnection, self.policy), req)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, policy: NetworkPolicy):
        super().__init__()
        self.policy = policy

    def https_open(self, req):
        kwargs = {"context": self._context}
        if hasattr(self, "_check_hostname"):  # Python < 3.12
            kwargs["check_hostname"] = self._check_hostname
        return self.do_open(_connection(req, _GuardedHTTPSConnection, self.policy), req, **kwargs)


class _RefuseLocalSchemes(urllib.request.BaseHandler):
    handler_order = 100  # before the default file/ftp/data handlers

    def _refuse(self, req):
        # wrapped as urllib wraps connection errors, so that every refusal reads the same
        raise urllib.error.URLError(PrivateNetworkRefused(f"{req.type}: url"))

    file_open = ftp_open = data_open = _refuse


def guarded_opener(policy: NetworkPolicy) -> urllib.request.OpenerDirector:
    """A urllib opener (proxies, redirects, ... as `build_opener`) whose connections obey `policy`."""
    return urllib.request.build_opener(
        _GuardedHTTPHandler(policy), _GuardedHTTPSHandler(policy), _RefuseLocalSchemes()
    )


_installed: NetworkPolicy | None = None


def install_guard(policy: NetworkPolicy) -> None:
    """Make `urllib.request.urlopen` in this process obey `policy` (img2dataset fetches with it)."""
    global _installed
    if policy.allow_private or policy == _installed:
        return
    urllib.request.install_opener(guarded_opener(policy))
    _installed = policy
