"""Refusing private-network targets while downloading a pool.

Metadata urls come from the open web: one that points at (or redirects to, or resolves to) a loopback,
private or link-local address would make the download a request forger against the machine's own
network, e.g. a cloud metadata service at 169.254.169.254. The check therefore runs where the socket
is opened: `install_guard` puts a urllib opener into the download worker whose connections resolve
the host once, refuse every blocked address and connect to a checked one (no second lookup that DNS
rebinding could answer differently). Redirects go through the same opener, so they are checked too.

Only http and https urls are fetched, whatever the policy: the opener has no handler for file:, ftp: or
data: urls (a `file://` url would put a local file into a shard) and refuses every other scheme.

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


SCHEMES = ("http", "https")  # all a pool's image urls need; every other scheme is refused, always
SCHEME_REFUSED = "refused url scheme"  # file:, ftp:, data:, ...: not a network target, never allowed


class PrivateNetworkRefused(OSError):
    def __init__(self, kind: str):
        super().__init__(f"{REFUSED} ({kind} address); {ALLOW_HINT}")
        self.kind = kind


class SchemeRefused(OSError):
    def __init__(self, scheme: str):
        super().__init__(f"{SCHEME_REFUSED} {scheme}: (only http and https urls are downloaded)")
        self.kind = f"{scheme}: url"


_IP = ipaddress.ip_network
# Address blocks that are not public internet destinations, with the kind a refusal names. The IANA
# special-purpose registries, listed here rather than taken from `ipaddress.is_global`, whose answer
# changes between Python versions (3.11 calls 192.0.0.8 and fec0::/10 global) and which cannot see
# through IPv6 forms that embed an IPv4 address (`_embedded_ipv4`).
_DENY_V4 = [
    (_IP("0.0.0.0/8"), "unspecified"),  # 0.0.0.0 connects to the local host on Linux
    (_IP("10.0.0.0/8"), "private"),
    (_IP("100.64.0.0/10"), "non-global"),  # shared address space (carrier-grade NAT)
    (_IP("127.0.0.0/8"), "loopback"),
    (_IP("169.254.0.0/16"), "link-local"),  # the cloud metadata services (169.254.169.254)
    (_IP("172.16.0.0/12"), "private"),
    (_IP("192.0.0.0/24"), "non-global"),  # IETF protocol assignments (192.0.0.8: the dummy address)
    (_IP("192.0.2.0/24"), "non-global"),  # documentation
    (_IP("192.88.99.0/24"), "reserved"),  # 6to4 relay anycast (deprecated)
    (_IP("192.168.0.0/16"), "private"),
    (_IP("198.18.0.0/15"), "non-global"),  # benchmarking
    (_IP("198.51.100.0/24"), "non-global"),  # documentation
    (_IP("203.0.113.0/24"), "non-global"),  # documentation
    (_IP("224.0.0.0/4"), "multicast"),
    (_IP("240.0.0.0/4"), "reserved"),  # and the broadcast address
]
_DENY_V6 = [
    (_IP("::/128"), "unspecified"),
    (_IP("::1/128"), "loopback"),
    (_IP("64:ff9b:1::/48"), "private"),  # local-use NAT64 (RFC 8215)
    (_IP("100::/64"), "reserved"),  # discard-only
    (_IP("2001::/23"), "non-global"),  # IETF protocol assignments (Teredo is read before this)
    (_IP("2001:db8::/32"), "non-global"),  # documentation
    (_IP("3fff::/20"), "non-global"),  # documentation
    (_IP("5f00::/16"), "non-global"),  # segment routing (SRv6) SIDs
    (_IP("fc00::/7"), "private"),  # unique local
    (_IP("fe80::/10"), "link-local"),
    (_IP("fec0::/10"), "site-local"),  # deprecated, still routed inside some sites
    (_IP("ff00::/8"), "multicast"),
]
_GLOBAL_UNICAST_V6 = _IP("2000::/3")  # every other IPv6 block is reserved or special
_NAT64 = _IP("64:ff9b::/96")  # well-known NAT64 prefix: reaches the IPv4 address in its last 32 bits
_TEREDO = _IP("2001::/32")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address] | None:
    """The IPv4 addresses an IPv6 address reaches through (IPv4-mapped, NAT64 well-known prefix, 6to4,
    Teredo: its server and client), or None for a plain IPv6 address."""
    if ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1 reaches 127.0.0.1
        return [ip.ipv4_mapped]
    if ip in _NAT64:
        return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
    if ip.sixtofour is not None:  # 2002:7f00:1::/48 is 6to4 of 127.0.0.1
        return [ip.sixtofour]
    if ip in _TEREDO and ip.teredo is not None:
        return list(ip.teredo)
    return None


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `ip` is not a public internet address (`loopback`, `link-local`, ...), or None if it is."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:  # judged by where it leads: the embedded IPv4 addresses
            return next((k for k in map(address_kind, embedded) if k is not None), None)
    for net, kind in _DENY_V4 if ip.version == 4 else _DENY_V6:
        if ip in net:
            return kind
    if ip.version == 6 and ip not in _GLOBAL_UNICAST_V6:
        return "reserved"
    if not ip.is_global:  # what this Python's tables add (newer registrations)
        return "non-global"
    return None


def _effective(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list:
    """The addresses an allow-list entry is matched against: the embedded IPv4 ones, else `ip`."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return embedded
    return [ip]


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
        nets = [ipaddress.ip_network(n, strict=False) for n in self.allowed_networks]
        reached = _effective(ip)
        allowed = all(any(a.version == n.version and a in n for n in nets) for a in reached)
        return None if allowed else kind

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

    @staticmethod
    def scheme_refusal(scheme: str) -> str | None:
        """Only http and https urls are fetched: urllib would also open file: (a local file into a
        shard), ftp: (unchecked connections) and data: urls. Refused whatever the policy allows."""
        return None if scheme.lower() in SCHEMES else f"{scheme}: url"


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


class _OnlyHttp(urllib.request.BaseHandler):
    """Refuses every url that is not http(s), before any handler (a proxy's included) sees it."""

    handler_order = 0

    def default_open(self, req):
        if req.type not in SCHEMES:
            # wrapped as urllib wraps connection errors, so that every refusal reads the same
            raise urllib.error.URLError(SchemeRefused(req.type))

    unknown_open = default_open


def guarded_opener(policy: NetworkPolicy) -> urllib.request.OpenerDirector:
    """A urllib opener for http(s) urls (proxies, redirects, error handling as `build_opener`) whose
    connections obey `policy`; it has no handler for file:, ftp: or data: urls and refuses every other
    scheme, whatever the policy allows."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        _OnlyHttp(),
        urllib.request.ProxyHandler(),
        _GuardedHTTPHandler(policy),
        _GuardedHTTPSHandler(policy),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPRedirectHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


_installed: tuple[NetworkPolicy, urllib.request.OpenerDirector] | None = None


def install_guard(policy: NetworkPolicy) -> urllib.request.OpenerDirector:
    """Make `urllib.request.urlopen` in this process obey `policy` (img2dataset fetches with it), also
    when private networks are allowed: schemes other than http(s) are refused always. Returns the
    opener that is installed."""
    global _installed
    if _installed is None or _installed[0] != policy or urllib.request._opener is not _installed[1]:
        opener = guarded_opener(policy)
        urllib.request.install_opener(opener)
        _installed = (policy, opener)
    return _installed[1]
