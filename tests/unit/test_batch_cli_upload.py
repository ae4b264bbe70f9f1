"""The batch CLI's upload body (``cluster/cli/batch.py``): a file name cannot break or add a header."""

from __future__ import annotations

import email
import email.policy

from pdserve.cluster.cli.batch import multipart_body


def _parts(body: bytes, boundary: str) -> list:
    msg = email.message_from_bytes(f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode() + body,
                                   policy=email.policy.HTTP)
    return list(msg.iter_parts())


def test_the_body_holds_the_purpose_and_the_file_as_sent() -> None:
    content = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    purpose, file = _parts(multipart_body("b0undary", "requests.jsonl", content), "b0undary")
    assert purpose.get_param("name", header="content-disposition") == "purpose"
    assert purpose.get_payload(decode=True) == b"batch"
    assert file.get_filename() == "requests.jsonl" and file.get_payload(decode=True) == content


def test_a_quote_or_a_line_break_in_the_file_name_is_escaped_not_a_new_header() -> None:
    name = 'we"ird\r\nX-Injected: 1\n.jsonl'
    parts = _parts(multipart_body("b0undary", name, b"{}\n"), "b0undary")
    assert len(parts) == 2
    file = parts[1]
    assert file.get_filename() == "we%22ird%0D%0AX-Injected: 1%0A.jsonl"
    assert sorted(k.lower() for k in file.keys()) == ["content-disposition", "content-type"]
    assert file.get_payload(decode=True) == b"{}\n"
