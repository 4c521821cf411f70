"""The signed record (issue 29): `k3load sign RUN --key` and `k3load verify RUN --allowed-signers`, with keys made
in the test by OpenSSH's own ssh-keygen (Debian's openssh-client: `make test` installs it; missing, these tests
skip outside CI and fail under it).

What they hold it to: a run signed by the lead verifies against the team's allowed signers, naming them; no edit
of an evidence file passes, whether its manifest line is recomputed or not; a signer outside the allowed file is
refused; two signers both verify; every input the command cannot use is one line, exit 2, nothing signed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3load.analysis.outputs import manifest
from k3load.cli import main
from k3load.signing import keygen, record, sshsig


def _openssh() -> None:
    if shutil.which("ssh-keygen") and shutil.which("ssh-agent"):
        return
    if os.environ.get("CI"):
        pytest.fail("ssh-keygen is missing on CI: `make test` installs Debian's openssh-client first")
    pytest.skip("OpenSSH's client is not installed here (make openssh installs it on Debian)")


def _key(folder: Path, name: str, comment: str, passphrase: str = "") -> Path:
    _openssh()
    path = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)
    return path


def _allowed(folder: Path, *entries: tuple[str, Path]) -> Path:
    path = folder / "allowed_signers"
    path.write_text("".join(f'{who} namespaces="k3load" {key.with_name(key.name + ".pub").read_text().strip()}\n'
                            for who, key in entries))
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A judged run as far as signing reads it: evidence files and the manifest k3load analyze writes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "r1"}))
    (run / "verdict.json").write_text(json.dumps({"verdict": "limited", "exit_code": 3}))
    (run / "report.md").write_text("# k3load report\n\nverdict: limited\n")
    manifest.write(run)
    return run


def _verify(run: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["verify", str(run), *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_run_signed_by_the_lead_verifies_against_the_teams_allowed_signers(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lead = _key(tmp_path, "lead", "lead@example.com")
    assert main(["sign", str(run_dir), "--key", str(lead)]) == 0
    said = capsys.readouterr().out
    assert "as lead@example.com (ssh-ed25519 SHA256:" in said
    allowed = _allowed(tmp_path, ("lead@example.com", lead))
    code, out = _verify(run_dir, "--allowed-signers", str(allowed), "--require-signature", capsys=capsys)
    assert code == 0 and "signed by lead@example.com" in out and "signature 1 (lead@example.com;" in out, out
    signer = record.read_signers(run_dir)[0]
    assert signer.identity == "lead@example.com" and signer.fingerprint in out
    assert manifest.verify(run_dir) == []  # the signature files are beside the manifest, never in it
    code, out = _verify(run_dir, capsys=capsys)
    assert code == 0 and "signers not checked (no --allowed-signers)" in out


def test_a_forged_verdict_fails_whether_or_not_its_manifest_line_is_recomputed(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lead = _key(tmp_path, "lead", "lead@example.com")
    assert main(["sign", str(run_dir), "--key", str(lead)]) == 0
    allowed = _allowed(tmp_path, ("lead@example.com", lead))
    (run_dir / "verdict.json").write_text(json.dumps({"verdict": "go", "exit_code": 0}))
    code, out = _verify(run_dir, "--allowed-signers", str(allowed), capsys=capsys)
    assert code == 1 and "changed: verdict.json" in out
    manifest.write(run_dir)  # the forger recomputes the manifest: every file matches it again
    assert manifest.verify(run_dir) == []
    code, out = _verify(run_dir, "--allowed-signers", str(allowed), capsys=capsys)
    assert code == 1 and "does not match: not over this manifest.sha256" in out and "FAILED" in out, out
    code, out = _verify(run_dir, capsys=capsys)  # without the allowed signers too: the key's own check
    assert code == 1 and "does not match" in out


def test_a_signer_outside_the_allowed_file_is_refused_and_two_signers_both_verify(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    operator, lead = _key(tmp_path, "op", "operator@example.com"), _key(tmp_path, "lead", "")
    assert main(["sign", str(run_dir), "--key", str(operator)]) == 0
    assert main(["sign", str(run_dir), "--key", str(lead)]) == 2  # no comment: who is it?
    assert "give --identity" in capsys.readouterr().err
    for bad in ("lead<!--/k3load:judge-->", "a|b", "two\nlines"):  # written into the reports' regions and tables
        assert main(["sign", str(run_dir), "--key", str(lead), "--identity", bad]) == 2
        assert "a principal is printable text" in capsys.readouterr().err
    assert main(["sign", str(run_dir), "--key", str(lead), "--identity", "lead@example.com"]) == 0
    assert [s.identity for s in record.read_signers(run_dir)] == ["operator@example.com", "lead@example.com"]
    only_lead = _allowed(tmp_path, ("lead@example.com", lead))
    code, out = _verify(run_dir, "--allowed-signers", str(only_lead), capsys=capsys)
    assert code == 1 and "signature 1 (claims operator@example.com;" in out and "signer not allowed" in out, out
    both = _allowed(tmp_path, ("lead@example.com", lead), ("operator@example.com", operator))
    code, out = _verify(run_dir, "--allowed-signers", str(both), capsys=capsys)
    assert code == 0 and "signed by lead@example.com, operator@example.com" in out, out


def test_a_claimed_identity_is_not_trusted(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A signer who claims to be the lead with their own key is named by the allowed file's principal for that key."""
    lead, mallory = _key(tmp_path, "lead", "lead@example.com"), _key(tmp_path, "m", "m@example.com")
    assert main(["sign", str(run_dir), "--key", str(mallory), "--identity", "lead@example.com"]) == 0
    code, out = _verify(run_dir, "--allowed-signers", str(_allowed(tmp_path, ("lead@example.com", lead))),
                        capsys=capsys)
    assert code == 1 and "signer not allowed" in out and "signed by" not in out


def test_no_signature_fails_only_when_required(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _openssh()
    code, out = _verify(run_dir, capsys=capsys)
    assert code == 0 and "not signed" in out
    code, out = _verify(run_dir, "--require-signature", capsys=capsys)
    assert code == 1 and "no signature" in out


def test_a_protected_key_signs_through_its_agent_and_not_without(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key(tmp_path, "locked", "lead@example.com", passphrase="correct horse")
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    assert main(["sign", str(run_dir), "--key", str(key)]) == 2
    err = capsys.readouterr().err
    assert "passphrase-protected" in err and "no ssh-agent holds it" in err and len(err.splitlines()) == 1
    assert not (run_dir / record.SIGNATURES).exists()
    agent = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    env = dict(line.split(";")[0].split("=", 1) for line in agent.splitlines() if "=" in line.split(";")[0])
    try:
        monkeypatch.setenv("SSH_AUTH_SOCK", env["SSH_AUTH_SOCK"])
        subprocess.run(["ssh-keygen", "-p", "-P", "correct horse", "-N", "", "-f", str(key)], check=True,
                       capture_output=True)  # a copy the agent can load without a prompt
        subprocess.run(["ssh-add", "-q", str(key)], check=True, capture_output=True, env={**os.environ, **env})
        subprocess.run(["ssh-keygen", "-p", "-P", "", "-N", "correct horse", "-f", str(key)], check=True,
                       capture_output=True)  # protected again on disk
        assert main(["sign", str(run_dir), "--key", str(key)]) == 0
        assert "as lead@example.com" in capsys.readouterr().out
    finally:
        subprocess.run(["kill", env["SSH_AGENT_PID"]], check=False)


@pytest.mark.parametrize("case, said", [
    ("no_manifest", "no manifest.sha256"), ("unreadable_key", "cannot read it"), ("not_a_run", "not a run directory"),
    ("changed", "no longer matches manifest.sha256"), ("no_ssh_keygen", "ssh-keygen not found")])
def test_what_cannot_be_signed_is_one_line_exit_2_nothing_signed(
        run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        case: str, said: str) -> None:
    key = _key(tmp_path, "k", "k@example.com")
    target = run_dir
    if case == "no_manifest":
        (run_dir / "manifest.sha256").unlink()
    elif case == "unreadable_key":
        key = tmp_path / "missing"
    elif case == "not_a_run":
        target = tmp_path / "plain"
        target.mkdir()
    elif case == "changed":
        (run_dir / "report.md").write_text("edited")
    else:
        monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    assert main(["sign", str(target), "--key", str(key)]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert not (target / record.SIGNATURES).exists()


def test_an_unreadable_signature_block_is_named(run_dir: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _openssh()
    (run_dir / record.SIGNATURES).write_text(f"{sshsig.BEGIN}\nbm90IGEgc2lnbmF0dXJl\n{sshsig.END}\n")
    code, out = _verify(run_dir, capsys=capsys)
    assert code == 1 and "signature 1 (no claimed signer; key unknown): unreadable: not an SSHSIG signature" in out


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400) | st.binary(max_size=300).map(
    lambda b: f"{sshsig.BEGIN}\n{__import__('base64').b64encode(b'SSHSIG' + b).decode()}\n{sshsig.END}\n"))
def test_any_signature_text_is_read_or_refused_never_raised(text: str) -> None:
    for block in sshsig.split_armored(text) or [text]:
        try:
            info = sshsig.read_block(block)
        except sshsig.SignatureFormatError as exc:
            assert str(exc)
        else:
            assert info.fingerprint.startswith("SHA256:")


def test_re_judging_keeps_the_signatures_while_the_manifest_is_the_same_and_sets_them_aside_stale_after(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`k3load analyze` on a signed run: the same evidence gives the same manifest, byte for byte, and the
    signatures still cover it; once the evidence differs the new manifest is not what was signed, and the
    signatures are kept, marked stale, with the manifest they signed (they still verify against it)."""
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "scale-run", run)
    main(["analyze", str(run)])
    lead = _key(tmp_path, "lead", "lead@example.com")
    allowed = _allowed(tmp_path, ("lead@example.com", lead))
    assert main(["sign", str(run), "--key", str(lead)]) == 0
    main(["analyze", str(run)])
    capsys.readouterr()
    code, out = _verify(run, "--allowed-signers", str(allowed), "--require-signature", capsys=capsys)
    assert code == 0 and "signed by lead@example.com" in out, out
    (run / "operator-notes.txt").write_text("an evidence file added after signing\n")
    main(["analyze", str(run)])
    assert "signature(s) (lead@example.com) no longer cover the run" in capsys.readouterr().err
    kept = run / record.STALE / "1"
    assert sorted(p.name for p in kept.iterdir()) == [record.MANIFEST, record.SIGNATURES, record.SIGNERS]
    code, out = _verify(run, "--allowed-signers", str(allowed), "--require-signature", capsys=capsys)
    assert code == 1 and "no signature" in out and "stale: 1 signature(s) (lead@example.com)" in out, out
    signed = (kept / record.MANIFEST).read_bytes()
    block = (kept / record.SIGNATURES).read_text()
    assert keygen.matches(block, signed) and keygen.principals(block, allowed) == ["lead@example.com"]


def test_the_reports_say_who_signed_and_an_edit_of_that_fails_verification(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`k3load sign` writes the signer into report.md's and report.html's signature table and checklist judge
    line without changing what the signature covers; editing those, the signers file, or the report
    elsewhere, fails `k3load verify`."""
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "scale-run", run)
    main(["analyze", str(run)])
    unsigned = (run / "report.md").read_text()
    assert "| signed by | not signed yet (k3load sign) |" in unsigned
    assert "<!--k3load:judge-->judge to be filled in before signing<!--/k3load:judge-->" in unsigned
    operator, lead = _key(tmp_path, "op", "operator@example.com"), _key(tmp_path, "lead", "lead@example.com")
    allowed = _allowed(tmp_path, ("lead@example.com", lead), ("operator@example.com", operator))
    assert main(["sign", str(run), "--key", str(operator)]) == 0
    assert main(["sign", str(run), "--key", str(lead)]) == 0
    signers = record.read_signers(run)
    for name in ("report.md", "report.html"):
        text = (run / name).read_text()
        assert all(s.identity in text and s.fingerprint in text for s in signers), name
        assert "signed by operator@example.com (SHA256:" in text and "not signed yet" not in text, name
    capsys.readouterr()
    code, out = _verify(run, "--allowed-signers", str(allowed), "--require-signature", capsys=capsys)
    assert code == 0 and "signed by lead@example.com, operator@example.com" in out, out
    pristine = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}

    def edited(name: str, old: str, new: str) -> str:
        for path_name, data in pristine.items():
            (run / path_name).write_bytes(data)
        text = (run / name).read_text()
        assert old in text, (name, old)
        (run / name).write_text(text.replace(old, new, 1))
        code, out = _verify(run, "--allowed-signers", str(allowed), capsys=capsys)
        assert code == 1, (name, old, out)
        return out

    assert "report.md: its signer table does not say who signed" in edited(
        "report.md", "operator@example.com (as claimed)", "ceo@example.com (as claimed)")
    assert "report.html: its judge line does not say who signed" in edited(
        "report.html", "signed by operator@example.com", "signed by ceo@example.com")
    assert "changed: report.md" in edited("report.md", "# ", "# FORGED ")
    assert "signer 1 says key" in edited(record.SIGNERS, signers[0].fingerprint, signers[1].fingerprint)


def test_marker_text_that_came_in_with_the_evidence_fails_verification(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A region's content is not hashed: a second region (a quoted server error carrying the marker text)
    would hide whatever is inside it, so a report with more than one of a region is refused."""
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "scale-run", run)
    main(["analyze", str(run)])
    text = (run / "report.md").read_text()
    (run / "report.md").write_text(text.replace("# ", "# <!--k3load:judge-->anything<!--/k3load:judge--> ", 1))
    manifest.write(run)  # the forger's manifest: the report's hash leaves both regions' content out
    code, out = _verify(run, capsys=capsys)
    assert code == 1 and "report.md: 2 judge regions where k3load writes one" in out, out
