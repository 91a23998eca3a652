"""Key files, enrolment, group keys and signed documents."""

import json
import os
import stat

import pytest

from security.keys import GroupKey, Identity, KeyFileError, Keyring, PublicIdentity, enroll, revoked_names
from security.signing import InvalidDocument, sign_document, verify_document


def test_private_key_file_is_0600_and_round_trips(tmp_path):
    identity = Identity.generate("drone-01")
    path = identity.save(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Identity.load(path)
    assert loaded.public.fingerprint() == identity.public.fingerprint()
    assert PublicIdentity.load(tmp_path / "drone-01.pub").fingerprint() == identity.public.fingerprint()


def test_a_world_readable_private_key_is_refused_with_the_fix(tmp_path):
    path = Identity.generate("drone-01").save(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        Identity.load(path)


@pytest.mark.parametrize("content", ["not json", json.dumps({"name": "x", "ed25519": "AAAA", "x25519": "AAAA"})])
def test_malformed_key_files_are_refused(tmp_path, content):
    path = tmp_path / "x.key"
    path.write_text(content)
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError):
        Identity.load(path)


def test_names_that_cannot_be_topic_levels_are_refused():
    for bad in ("a/b", "+", "#", "", "-x", "x" * 65):
        with pytest.raises(ValueError):
            Identity.generate(bad)


def test_enrolment_folder_is_the_keyring(tmp_path):
    agents = [Identity.generate(f"a{i}") for i in range(3)]
    for a in agents:
        enroll(tmp_path / "enrolled", a.public)
    keyring = Keyring.load_dir(tmp_path / "enrolled")
    assert keyring.names() == ["a0", "a1", "a2"] and "a1" in keyring
    assert "a3" not in keyring and keyring.get("a3") is None


def test_group_key_serialization_and_rotation_ids():
    key = GroupKey.generate()
    assert GroupKey.from_bytes(key.to_bytes()) == key
    assert GroupKey.generate().key_id != key.key_id
    with pytest.raises(KeyFileError):
        GroupKey.from_bytes(b"short")


def test_signed_document_verifies_and_any_change_is_caught():
    server = Identity.generate("server")
    doc = sign_document({"round": 3, "selected": ["a", "b"]}, server)
    assert verify_document(json.loads(json.dumps(doc)), server.public) == {"round": 3, "selected": ["a", "b"]}
    tampered = {**doc, "body": {**doc["body"], "round": 4}}
    with pytest.raises(InvalidDocument, match="bad-signature"):
        verify_document(tampered, server.public)
    with pytest.raises(InvalidDocument, match="unknown-signer"):
        verify_document(sign_document({"round": 3}, Identity.generate("mallory")), Keyring([server.public]))
    with pytest.raises(InvalidDocument, match="malformed"):
        verify_document(["not", "a", "doc"], server.public)


def test_a_private_key_is_refused_where_a_public_one_belongs_and_never_copied(tmp_path):
    from skyfed import main

    Identity.generate("drone-01").save(tmp_path)
    with pytest.raises(KeyFileError, match=r"is a PRIVATE key: use the public key next to it \(drone-01.pub\)"):
        PublicIdentity.load(tmp_path / "drone-01.key")
    (tmp_path / "renamed.pub").write_text((tmp_path / "drone-01.key").read_text())
    with pytest.raises(KeyFileError, match=r"renamed.pub is a PRIVATE key: use drone-01.pub, which"):
        PublicIdentity.load(tmp_path / "renamed.pub")
    old_format = json.loads((tmp_path / "drone-01.key").read_text())
    del old_format["kind"]  # files written before key files said their kind: the suffix decides
    (tmp_path / "old.key").write_text(json.dumps(old_format))
    with pytest.raises(KeyFileError, match="PRIVATE"):
        PublicIdentity.load(tmp_path / "old.key")
    with pytest.raises(KeyFileError, match=r"is a public key; this needs the node's private key \(drone-01.key\)"):
        Identity.load(tmp_path / "drone-01.pub")
    enrolled = tmp_path / "enrolled"
    assert main(["keys", "enroll", str(tmp_path / "drone-01.key"), "--enrolled", str(enrolled)]) == 2
    assert not enrolled.exists() or not any(enrolled.iterdir())


def test_certs_command_makes_a_ca_broker_and_client_certificates_and_says_what_is_missing(tmp_path, capsys):
    from cryptography import x509

    from skyfed import main

    pki = tmp_path / "pki"
    assert main(["certs", "client", "drone-01", "--dir", str(pki)]) == 2
    assert "no CA in" in capsys.readouterr().err
    assert main(["certs", "ca", "--dir", str(pki), "--federation", "fleet"]) == 0
    assert main(["certs", "ca", "--dir", str(pki), "--federation", "fleet"]) == 2  # never replaced
    assert main(["certs", "broker", "--dir", str(pki), "--host", "127.0.0.1", "--host", "broker.lan"]) == 0
    assert main(["certs", "client", "drone-01", "--dir", str(pki)]) == 0
    cert = x509.load_pem_x509_certificate((pki / "drone-01.crt").read_bytes())
    assert cert.subject.rfc4514_string().startswith("CN=drone-01")
    assert stat.S_IMODE((pki / "drone-01.crt.key").stat().st_mode) == 0o600


def test_an_unreadable_key_says_who_owns_it_and_the_chown(tmp_path):
    from security.keys import _ownership

    path = Identity.generate("drone-01").save(tmp_path)
    text = _ownership(path)
    me = __import__("pwd").getpwuid(os.geteuid()).pw_name
    assert f"belongs to {me}" in text and f"chown {me}: {path}" in text


def test_revoke_moves_the_key_aside_and_enrolling_again_restores_it(tmp_path, capsys):
    from skyfed import main

    identity = Identity.generate("drone-01")
    enrolled = tmp_path / "enrolled"
    enroll(enrolled, identity.public)
    assert main(["keys", "revoke", "drone-01", "--enrolled", str(enrolled)]) == 0
    assert "rotates the group key" in capsys.readouterr().out
    assert Keyring.load_dir(enrolled).names() == [] and revoked_names(enrolled) == {"drone-01"}
    assert main(["keys", "revoke", "drone-01", "--enrolled", str(enrolled)]) == 2  # not enrolled any more
    enroll(enrolled, PublicIdentity.load(enrolled / "revoked" / "drone-01.pub"))
    assert Keyring.load_dir(enrolled).names() == ["drone-01"] and revoked_names(enrolled) == set()
