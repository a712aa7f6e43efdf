import os
import pickle
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qckpt.errors import CheckpointError
from qckpt.storage.dcp_metadata import SafeFileSystemReader, read_metadata_file


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/qckpt-pwned",))


def test_reads_real_dcp_metadata(tmp_path):
    sd = {"w": torch.randn(4, 4, dtype=torch.bfloat16), "n": {"k": torch.arange(3)}}
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    md = read_metadata_file(tmp_path / ".metadata")
    assert set(md.state_dict_metadata) == {"w", "n.k"}
    out = {
        "w": torch.zeros(4, 4, dtype=torch.bfloat16),
        "n": {"k": torch.zeros(3, dtype=torch.long)},
    }
    dcp.load(out, storage_reader=SafeFileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["n"]["k"], sd["n"]["k"])


def test_refuses_code_in_metadata(tmp_path):
    marker = "/tmp/qckpt-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="refusing to load posix.system"):
        read_metadata_file(tmp_path / ".metadata")
    # through DCP itself the refusal surfaces wrapped in DCP's CheckpointException (a
    # BaseException), message intact
    with pytest.raises(BaseException) as ei:
        dcp.load(
            {"w": torch.zeros(1)}, storage_reader=SafeFileSystemReader(str(tmp_path)), no_dist=True
        )
    assert "refusing to load posix.system" in "".join(traceback.format_exception(ei.value))
    assert not os.path.exists(marker)


def test_garbage_metadata_is_one_line_error(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"\x00not a pickle")
    with pytest.raises(CheckpointError, match="corrupt DCP metadata"):
        read_metadata_file(tmp_path / ".metadata")


def test_a_library_message_over_several_lines_becomes_one_line(tmp_path):
    # found by the DCP metadata fuzzer: the unpickler's own message wraps over two lines
    from qckpt.storage.dcp_metadata import read_metadata_file

    (tmp_path / ".metadata").write_bytes(b"\x80\x04P\x00.")  # a persistent-id load
    with pytest.raises(CheckpointError) as err:
        read_metadata_file(tmp_path / ".metadata")
    assert "\n" not in str(err.value) and str(err.value).startswith(str(tmp_path))
