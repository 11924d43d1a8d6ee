import pytest

from data.documents import read_documents


def test_plain_file_is_one_document_and_jsonl_one_per_line(tmp_path):
    plain = tmp_path / "a.py"
    plain.write_bytes("x = 1\r\n\ty = 'é'\n".encode("utf-8"))
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"text": "one\\n"}\n\n{"text": "two"}\n', encoding="utf-8")
    assert list(read_documents(str(plain))) == ["x = 1\r\n\ty = 'é'\n"]
    assert list(read_documents(str(lines))) == ["one\n", "two"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.txt", b"\xff\xfe", "not valid UTF-8"),
        ("bad.jsonl", b'{"text": "ok"}\n{oops\n', "line 2"),
        ("bad.jsonl", b'{"body": "no text"}\n', '"text" field'),
    ],
)
def test_bad_input_names_flag_and_place(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"--input {path}.*{message}"):
        list(read_documents(str(path)))


def test_missing_file():
    with pytest.raises(ValueError, match="--input /no/such/file: no such file"):
        list(read_documents("/no/such/file"))
