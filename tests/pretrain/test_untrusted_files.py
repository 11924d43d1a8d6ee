"""Files from elsewhere are read, never run: a manifest naming a path outside its checkpoint, a pickle
where tensors are expected, a YAML tag that would construct an object, an index pointing past its
data, each refused with one line naming the file (docs/architecture.md: "Files from elsewhere")."""

import json
import os
import struct

import numpy
import pytest
import torch

from pretrain.checkpoint.catalog import CheckpointError, read_file, read_manifest


def _checkpoint(tmp_path, files, latest="iter_0000001", tokenizer=None):
    directory = tmp_path / "ckpt"
    (directory / "iter_0000001").mkdir(parents=True)
    (directory / "latest").write_text(latest)
    manifest = {"format": 4, "iteration": 1, "layout": {}, "files": files}
    if tokenizer is not None:
        manifest["tokenizer"] = tokenizer
    (directory / "iter_0000001" / "manifest.json").write_text(json.dumps(manifest))
    return str(directory)


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "rank_00000.pt/../../../x",
                                  "sub/rank.pt"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_refused(tmp_path, name):
    directory = _checkpoint(tmp_path, {name: {"bytes": 1, "sha256": "0"}})
    with pytest.raises(CheckpointError, match=f"manifest.json: names '{name}', a file outside its checkpoint "
                                              "directory; refused"):
        read_manifest(directory)


def test_a_latest_pointer_or_tokenizer_path_leaving_the_checkpoint_is_refused(tmp_path):
    directory = _checkpoint(tmp_path, {}, latest="../../elsewhere")
    with pytest.raises(CheckpointError, match=r"latest: names '\.\./\.\./elsewhere', not a checkpoint"):
        read_manifest(directory)
    directory = _checkpoint(tmp_path / "t", {}, tokenizer={"tokenizer_type": "GPT2BPETokenizer",
                                                           "vocab_file": "../../../secret/vocab.json"})
    with pytest.raises(CheckpointError, match="names '../../../secret/vocab.json', a file outside"):
        read_manifest(directory)
    # a tokenizer's files in its own subdirectory are inside
    directory = _checkpoint(tmp_path / "ok", {}, tokenizer={"tokenizer_type": "GPT2BPETokenizer",
                                                            "vocab_file": "tokenizer/vocab.json"})
    assert read_manifest(directory)[1]["tokenizer"]["vocab_file"] == "tokenizer/vocab.json"


class _Runs:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_where_tensors_are_expected_is_refused_unrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / "rank_00000.pt")
    torch.save({"states": {"model": _Runs()}}, path)
    with pytest.raises(CheckpointError, match=r"rank_00000.pt: refused by torch.load\(weights_only=True\)"):
        read_file(path)
    assert not (tmp_path / "PWNED").exists()


def test_a_yaml_tag_that_constructs_objects_is_refused_unrun(tmp_path, monkeypatch):
    from launch.tools.scaling.sweep import load_sweep
    from pretrain.config.arguments import ConfigError, load_yaml

    monkeypatch.chdir(tmp_path)
    for text in ('seed: !!python/object/apply:os.system ["touch PWNED"]\n',
                 "lr: !!python/name:os.system\n"):
        (tmp_path / "run.yaml").write_text(text)
        with pytest.raises(ConfigError, match=r"^--config .*run.yaml: not valid YAML \(could not determine a "
                                              "constructor for the tag"):
            load_yaml(str(tmp_path / "run.yaml"))
        with pytest.raises(ValueError, match=r"run.yaml: not valid YAML \(could not determine a constructor"):
            load_sweep(str(tmp_path / "run.yaml"))
    assert not (tmp_path / "PWNED").exists()


def test_an_index_pointing_past_its_data_is_refused(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data.gpt_dataset import check_indexed_files

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for document in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        builder.add_document(torch.tensor(document, dtype=torch.int64), [len(document)])
    builder.finalize(prefix + ".idx")
    check_indexed_files(prefix)  # whole
    index = bytearray(open(prefix + ".idx", "rb").read())
    sequences = struct.unpack("<Q", index[18:26])[0]
    pointers = 34 + sequences * 4  # after the header and the int32 lengths: one int64 pointer per sequence
    index[pointers:pointers + 8] = struct.pack("<q", 1 << 40)  # the first document, a terabyte on
    open(prefix + ".idx", "wb").write(bytes(index))  # (its size, and the last pointer, unchanged)
    with pytest.raises(ValueError, match=r"corpus.idx points past .*corpus.bin \(sequence 0: bytes "
                                         r"1099511627776\.\.1099511627782 of 18\); rebuild it"):
        check_indexed_files(prefix)
