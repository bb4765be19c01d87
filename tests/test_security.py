"""Who may use which routes (restricted_api, the loopback default for the model repository), secrets kept out
of every answer and log, nosniff, the workers' dropped privileges, and HTTPS on a certificate made here."""

from __future__ import annotations

import datetime
import http.client
import ssl
from pathlib import Path

import pytest

from conftest import start_server, wait_for

SECRET = "s3cret-Value-7f2e"  # the test greps for it everywhere

# One path of each group, with a method that reaches it; the blob model serves as `blob`.
GROUP_PROBES = {
    "model-repository": ("POST", "/v2/repository/index"),
    "metadata": ("GET", "/models"),
    "statistics": ("GET", "/metrics"),
    "inference": ("POST", "/detect"),
    "health": ("GET", "/healthz"),
}


@pytest.mark.parametrize("path, group", [
    ("/v2/repository/index", "model-repository"), ("/v2/repository/models/m/load", "model-repository"),
    ("/v2/repository/models/m/unload", "model-repository"),
    ("/models", "metadata"), ("/models/m", "metadata"), ("/gpu", "metadata"), ("/", "metadata"),
    ("/v2", "metadata"), ("/v2/models/m", "metadata"), ("/v2/models/m/versions/2", "metadata"),
    ("/v1/models/m", "metadata"), ("/v1/models/m/metadata", "metadata"), ("/openapi.json", "metadata"),
    ("/metrics", "statistics"),
    ("/detect", "inference"), ("/models/m/detect", "inference"), ("/v2/models/m/infer", "inference"),
    ("/v2/models/m/versions/2/infer", "inference"), ("/v1/models/m:predict", "inference"),
    ("/v1/models/m/versions/2:predict", "inference"),
    ("/healthz", "health"), ("/readyz", "health"), ("/v2/health/live", "health"), ("/v2/health/ready", "health"),
    ("/v2/models/m/ready", "health"), ("/v2/models/m/versions/2/ready", "health"),
])
def test_every_route_falls_in_its_group(path, group):
    from app.http.access import route_group

    assert route_group(path) == group


def test_restricted_api_parses_tritons_form():
    from app.access import parse_restricted_api

    parsed = parse_restricted_api(f"model-repository:Admin-Key={SECRET}; metadata,statistics:ops-key=t0ken=x")
    assert [(sorted(r.groups), r.header, r.value) for r in parsed] == [
        (["model-repository"], "admin-key", SECRET), (["metadata", "statistics"], "ops-key", "t0ken=x")]
    assert SECRET not in repr(parsed)
    assert parse_restricted_api("") == ()


@pytest.mark.parametrize("text, fragment", [
    (f"nonsense{SECRET}", "each entry must be"),
    (f"admin:key={SECRET}", "unknown group 'admin'"),
    (f"inference:bad header={SECRET}", "HTTP token"),
    ("inference:key=", "must not be empty"),
    (f"inference:a={SECRET};inference,health:b={SECRET}", "restricted twice"),
])
def test_a_bad_restricted_api_is_refused_at_boot_without_echoing_its_value(text, fragment):
    from app.errors import ConfigError
    from app.settings import load_settings

    with pytest.raises(ConfigError) as refused:
        load_settings(environ={"DETECT_RESTRICTED_API": text})
    assert fragment in str(refused.value) and SECRET not in str(refused.value)
    assert "(hidden)" in str(refused.value)


@pytest.mark.parametrize("group", list(GROUP_PROBES))
def test_each_group_restricted_in_turn(app_factory, group):
    from blob_model import blob_image
    from images_for_tests import encode

    client = app_factory(restricted_api=f"{group}:x-key={SECRET}").test_client()
    image = encode(blob_image(32, 32, {1: (4, 4, 12, 12)}))

    def call(method, path, headers=None):
        body = image if path == "/detect" else None
        return client.open(path, method=method, data=body, headers={"Content-Type": "image/png", **(headers or {})})

    method, path = GROUP_PROBES[group]
    for headers in ({}, {"x-key": "wrong"}, {"x-key": SECRET[:-1]}, {"other": SECRET}):
        refused = call(method, path, headers)
        assert refused.status_code == 403
        shape = refused.get_json()
        message = shape["error"] if isinstance(shape["error"], str) else shape["error"]["message"]
        assert group in message and "x-key" in message and SECRET not in refused.get_data(as_text=True)
        assert refused.headers["X-Content-Type-Options"] == "nosniff"
    assert call(method, path, {"X-Key": SECRET}).status_code == 200  # header names are case-blind
    for other, (other_method, other_path) in GROUP_PROBES.items():
        if other != group:
            assert call(other_method, other_path).status_code == 200, other


def test_a_refusal_has_the_protocols_own_shape(app_factory):
    client = app_factory(restricted_api=f"metadata:x-key={SECRET}").test_client()
    detect_shape = client.get("/models").get_json()
    assert detect_shape["error"]["code"] == "forbidden"
    v2_shape = client.post("/v2/repository/index", environ_base={"REMOTE_ADDR": "10.1.2.3"}).get_json()
    assert isinstance(v2_shape["error"], str) and "loopback" in v2_shape["error"]


@pytest.mark.parametrize("address, loopback", [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
                                               ("10.0.0.7", False), ("::ffff:10.0.0.7", False), ("", False)])
def test_loopback_is_recognized_in_every_form_a_dual_stack_listener_reports(address, loopback):
    from app.access import is_loopback

    assert is_loopback(address) is loopback


def test_the_model_repository_answers_loopback_clients_only_unless_granted_to_a_header(app_factory):
    open_client = app_factory().test_client()
    for address in ("127.0.0.1", "::1", "127.8.9.10"):
        assert open_client.post("/v2/repository/index", environ_base={"REMOTE_ADDR": address}).status_code == 200
    for address in ("10.1.2.3", "192.168.0.7", "2001:db8::1", ""):
        refused = open_client.post("/v2/repository/index", environ_base={"REMOTE_ADDR": address})
        assert refused.status_code == 403, address
        assert "loopback" in refused.get_json()["error"]
    # The other groups stay open to everyone.
    assert open_client.get("/models", environ_base={"REMOTE_ADDR": "10.1.2.3"}).status_code == 200
    granted = app_factory(restricted_api=f"model-repository:admin-key={SECRET}").test_client()
    remote = {"REMOTE_ADDR": "10.1.2.3"}
    assert granted.post("/v2/repository/index", environ_base=remote, headers={"admin-key": SECRET}).status_code == 200
    assert granted.post("/v2/repository/index", environ_base=remote).status_code == 403
    # Granted to a header, the header is needed from loopback too.
    assert granted.post("/v2/repository/index").status_code == 403


def test_tritonclient_loads_and_unloads_only_with_the_header_and_no_secret_leaks(blob_model_dir, tmp_path):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_SPARE_WORKERS": "0",
                           "DETECT_LOG_LEVEL": "DEBUG",
                           "DETECT_RESTRICTED_API": f"model-repository:admin-key={SECRET}"}, tmp_path / "server.log")
    seen = []
    try:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        with pytest.raises(InferenceServerException) as refused:
            client.unload_model("blob")
        seen.append(str(refused.value))
        assert "model-repository" in str(refused.value)
        with pytest.raises(InferenceServerException):
            client.unload_model("blob", headers={"admin-key": "wrong"})
        client.unload_model("blob", headers={"admin-key": SECRET})

        def state():
            return server.request("GET", "/models/blob")[2]["state"]

        wait_for(lambda: state() == "unloaded", 60, "blob unloaded")
        client.load_model("blob", headers={"admin-key": SECRET})
        assert state() == "ready"
        assert [m["name"] for m in client.get_model_repository_index(headers={"admin-key": SECRET})] == ["blob"]
        for path in ("/metrics", "/models", "/gpu", "/openapi.json", "/nope"):
            seen.append(server.request("GET", path)[2])
        client.close()
    finally:
        server.stop()
    assert "restricted API: model-repository need header admin-key" in server.log()
    for text in [server.log(), *map(str, seen)]:
        assert SECRET not in text


def test_every_answer_says_nosniff(server):
    for method, path, body in (("GET", "/healthz", None), ("GET", "/nope", None), ("POST", "/detect", b"junk"),
                               ("GET", "/models", None), ("GET", "/metrics", None)):
        headers = server.request(method, path, body, {"Content-Type": "image/png"})[1]
        assert headers.get("X-Content-Type-Options") == "nosniff", path
    # A refusal written by the Twisted site, before the app runs: a body over the limit.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/detect", body=b"", headers={"Content-Length": str(10**9), "Content-Type": "image/png"})
    refused = conn.getresponse()
    assert refused.status == 413 and refused.getheader("X-Content-Type-Options") == "nosniff"
    conn.close()


def test_an_error_never_echoes_request_bytes_unescaped(server):
    path = "/models/<script>alert(1)</script>"
    status, headers, body = server.request("GET", path)
    assert status == 404 and headers["Content-Type"].startswith("application/json")
    raw = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    raw.request("GET", path)
    text = raw.getresponse().read().decode()
    raw.close()
    assert "<script>" not in text
    assert "<script>alert(1)</script>" in body["error"]["message"]  # the same JSON, escaped


def test_workers_run_without_new_privileges_and_with_a_private_umask(server):
    status, _, models = server.request("GET", "/models")
    pid = models["models"][0]["pid"]
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    assert fields["NoNewPrivs"].strip() == "1"
    if "Umask" in fields:  # Linux 4.7 and later
        assert fields["Umask"].strip() == "0077"


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_https_on_a_self_signed_certificate(blob_model_dir, tmp_path):
    pytest.importorskip("OpenSSL", reason="HTTPS needs the tls extra (pyOpenSSL), which the test extra installs")
    cert_file, key_file = _self_signed(tmp_path)
    server = start_server({"DETECT_MODEL": str(blob_model_dir), "DETECT_SPARE_WORKERS": "0",
                           "DETECT_TLS_CERT_FILE": str(cert_file), "DETECT_TLS_KEY_FILE": str(key_file)},
                          tmp_path / "server.log")
    try:
        context = ssl.create_default_context(cafile=str(cert_file))
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=30)
        conn.request("GET", "/readyz")
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("X-Content-Type-Options") == "nosniff"
        conn.close()
        plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/readyz")
            plain.getresponse()
        plain.close()
        assert "listening on https://" in server.log()
    finally:
        server.stop()


def test_https_needs_both_files(tmp_path):
    from app.errors import ConfigError
    from app.settings import load_settings

    with pytest.raises(ConfigError, match="both"):
        load_settings(environ={"DETECT_TLS_CERT_FILE": str(tmp_path / "cert.pem")})
