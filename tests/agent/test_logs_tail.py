"""`LogTail`: a log being written, rotated, truncated and appended to, read once each."""

from __future__ import annotations

import os
from pathlib import Path

from ampwatch.agent.logs.tail import LogTail


def test_a_partial_last_line_waits_for_its_newline(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"one\ntw")
    with LogTail(log) as tail:
        assert tail.poll() == ["one"]
        assert tail.poll() == []
        with log.open("ab") as out:
            out.write(b"o\r\nthree\n")
        assert tail.poll() == ["two", "three"]  # "\r\n" endings lose their "\r"


def test_tqdm_redraws_count_as_complete_pieces(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b" 1/9 [00:01]\r 2/9 [00:02]\r 3/9 [00")
    with LogTail(log) as tail:
        assert tail.poll() == [" 1/9 [00:01]\r 2/9 [00:02]"]  # the bar's line has no "\n" yet
        with log.open("ab") as out:
            out.write(b":03]\n")
        assert tail.poll() == [" 3/9 [00:03]"]


def test_rotation_reads_the_old_file_to_its_end_then_the_new_one(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"a\nb\n")
    with LogTail(log) as tail:
        assert tail.poll() == ["a", "b"]
        with log.open("ab") as out:
            out.write(b"c\nunterminated")
        os.rename(log, tmp_path / "train.log.1")  # logrotate's rename
        assert tail.poll() == ["c"]
        assert tail.poll() == []  # the new file is not there yet
        log.write_bytes(b"d\n")
        assert tail.poll() == ["unterminated", "d"]
        assert tail.rotations == 1


def test_truncation_reads_again_from_the_start(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"first process line 1\nfirst process line 2\n")
    with LogTail(log) as tail:
        assert len(tail.poll()) == 2
        with log.open("r+b") as out:  # copytruncate, or a job rewriting its log with ">"
            out.truncate(0)
        assert tail.poll() == []
        with log.open("ab") as out:
            out.write(b"second\n")
        assert tail.poll() == ["second"]
        assert tail.truncations == 1


def test_from_end_skips_what_is_there(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"old\n")
    with LogTail(log, from_end=True) as tail:
        assert tail.poll() == []
        with log.open("ab") as out:
            out.write(b"new\n")
        assert tail.poll() == ["new"]


def test_a_missing_file_is_waited_for(tmp_path: Path) -> None:
    with LogTail(tmp_path / "later.log") as tail:
        assert tail.poll() == []
        (tmp_path / "later.log").write_bytes(b"x\n")
        assert tail.poll() == ["x"]
