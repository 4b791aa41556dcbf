"""The ready file a served process writes and `pdserve up` reads: its gRPC address, then the metrics port it
bound (so `--metrics-port 0` is told where it landed, and a restart binds the same port)."""

from pathlib import Path

from pdserve.launcher import parse_ready
from pdserve.serve import write_ready


def test_the_ready_file_names_the_address_and_the_bound_metrics_port(tmp_path: Path) -> None:
    path = tmp_path / "decode-0.ready"
    write_ready(str(path), "127.0.0.1:40123", 40124)
    assert path.read_text() == "127.0.0.1:40123\nmetrics 40124"
    assert parse_ready(path.read_text()) == ("127.0.0.1:40123", 40124)
    assert not (tmp_path / "decode-0.ready.tmp").exists()


def test_without_metrics_the_ready_file_holds_the_address_alone(tmp_path: Path) -> None:
    path = tmp_path / "gateway.ready"
    write_ready(str(path), "[::1]:50051")
    assert path.read_text() == "[::1]:50051"
    assert parse_ready(path.read_text()) == ("[::1]:50051", None)


def test_no_path_writes_nothing(tmp_path: Path) -> None:
    write_ready(None, "127.0.0.1:1", 2)
    assert list(tmp_path.iterdir()) == []
