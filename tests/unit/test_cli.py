"""The CLI takes every default from ServerOptions; logging set-up lives in torchpool.logs;
the command line's own checks (torchpool/cli) refuse with one line and their exit status."""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from torchpool import __version__
from torchpool.broker.options import ServerOptions
from torchpool.cli import build_parser, errors, main
from torchpool.cli.client_commands import average_us, table
from torchpool.cli.errors import CliError
from torchpool.cli.inputs import DATATYPE_NAMES, input_value, output_row, parse_spec, parse_specs
from torchpool.cli.preflight import check_ports, check_repository
from torchpool.cli.urls import url_problem
from torchpool.logs import setup_logging
from torchpool.protocol.datatypes import WIRE_DATATYPES

# ServerOptions fields with no command-line flag (set by code or tests only)
NOT_ON_THE_COMMAND_LINE = {"model_repository", "listen", "worker_shm_limit", "max_restarts", "load_models"}


def test_serve_defaults_are_the_server_options_defaults() -> None:
    args = vars(build_parser().parse_args(["serve", "--model-repository", "repo"]))
    checked = 0
    for f in dataclasses.fields(ServerOptions):
        if f.name in NOT_ON_THE_COMMAND_LINE:
            continue
        if f.name in ("local_allow_users", "local_allow_groups", "metrics_config", "allow_client_shm_prefixes"):
            assert args[f.name] is None and f.default_factory() == []   # repeatable flags
        elif f.name == "log_level":
            assert getattr(logging, args["log_level"].upper()) == f.default
        elif f.default is dataclasses.MISSING:     # a default read from the environment
            assert args[f.name] == f.default_factory(), f.name
        else:
            assert args[f.name] == f.default, f.name
        checked += 1
    assert checked == len(dataclasses.fields(ServerOptions)) - len(NOT_ON_THE_COMMAND_LINE)


def test_the_knobs_that_were_environment_only_are_flags_with_the_environment_as_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchpool.cli.serve import server_options

    def options(*flags: str) -> ServerOptions:
        return server_options(build_parser().parse_args(["serve", "--model-repository", "repo", *flags]),
                              logging.INFO)

    monkeypatch.delenv("TORCHPOOL_OUTPUT_CAPTURE_MIB", raising=False)
    monkeypatch.delenv("TORCHPOOL_STREAM_COPY_BYTES", raising=False)
    plain = options()
    assert (plain.output_capture_mib, plain.stream_copy_bytes) == (256, 0)
    flagged = options("--output-capture-mib", "0", "--stream-copy-bytes", "12M")
    assert (flagged.output_capture_mib, flagged.stream_copy_bytes) == (0, 12 << 20)
    # an operator's environment still works, as the default; a flag wins over it
    monkeypatch.setenv("TORCHPOOL_OUTPUT_CAPTURE_MIB", "16")
    monkeypatch.setenv("TORCHPOOL_STREAM_COPY_BYTES", str(8 << 20))
    from_env = options()
    assert (from_env.output_capture_mib, from_env.stream_copy_bytes) == (16, 8 << 20)
    both = options("--output-capture-mib", "64", "--stream-copy-bytes", "0")
    assert (both.output_capture_mib, both.stream_copy_bytes) == (64, 0)
    with pytest.raises(SystemExit):
        options("--output-capture-mib", "-1")


def test_json_logging_carries_the_traceback(capsys) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert setup_logging("warning", "json") == logging.WARNING
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            logging.getLogger("torchpool.worker").error("batch %d failed", 3, exc_info=exc)
        entry = json.loads(capsys.readouterr().err.strip())
        assert entry["message"] == "batch 3 failed" and entry["level"] == "ERROR"
        assert "Traceback" in entry["exception"] and "RuntimeError: boom" in entry["exception"]
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


# --- the command line's own checks (torchpool/cli): one line, the exit status ----------------

def refusal(call, *args) -> CliError:
    with pytest.raises(CliError) as caught:
        call(*args)
    return caught.value


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"torchpool {__version__} (torch {metadata.version('torch')})\n"


def test_serve_help_lists_every_exit_status(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for status, what in errors.EXIT_STATUSES:
        assert f"  {status}  {what}\n" in out
    assert len({status for status, _ in errors.EXIT_STATUSES}) == len(errors.EXIT_STATUSES)


def test_exit_on_error_takes_tritons_boolean(capsys) -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--model-repository", "r"]).exit_on_error is False
    assert parse(["serve", "--model-repository", "r", "--exit-on-error"]).exit_on_error is True
    assert parse(["serve", "--model-repository", "r", "--exit-on-error=true"]).exit_on_error is True
    assert parse(["serve", "--model-repository", "r", "--exit-on-error=false"]).exit_on_error is False
    with pytest.raises(SystemExit) as done:
        parse(["serve", "--model-repository", "r", "--exit-on-error=maybe"])
    assert done.value.code == errors.USAGE
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err


def test_url_problems() -> None:
    assert url_problem("ipc:///tmp/x.sock") is None and url_problem("tcp://127.0.0.1:8555") is None
    assert url_problem("tcp://*:0") is None and url_problem("tcp://[::1]:8555") is None
    assert url_problem("/run/t.sock") == "expected a URL such as ipc:///run/t.sock or tcp://127.0.0.1:8555"
    assert url_problem("t.sock") == "expected a URL such as ipc:///tmp/torchpool.sock or tcp://127.0.0.1:8555"
    assert url_problem("ipc://") == "expected a socket path after ipc://, e.g. ipc:///tmp/torchpool.sock"
    for bad in ("tcp://127.0.0.1", "tcp://:80", "tcp://h:http", "tcp://h:70000"):
        assert url_problem(bad) == "expected tcp://HOST:PORT with a port number, e.g. tcp://127.0.0.1:8555"
    assert url_problem("udp://h:1").startswith("only ipc:// and tcp:// addresses are served")


def test_the_repository_must_be_a_readable_directory(tmp_path: Path) -> None:
    check_repository(str(tmp_path))
    missing = refusal(check_repository, str(tmp_path / "none"))
    assert (missing.status, missing.message) == (errors.REPOSITORY, f"--model-repository {tmp_path}/none: "
                                                                    "no such directory")
    (tmp_path / "f").write_text("x")
    assert refusal(check_repository, str(tmp_path / "f")).message == f"--model-repository {tmp_path}/f: not a directory"
    if os.geteuid() != 0:            # root reads any directory
        locked = tmp_path / "locked"
        locked.mkdir(mode=0)
        try:
            assert refusal(check_repository, str(locked)).message == \
                f"--model-repository {locked}: cannot be read: permission denied"
        finally:
            locked.chmod(0o700)


def test_ports_are_probed_and_not_shared() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = refusal(check_ports, [("--http-port", "HTTP", "127.0.0.1", port)])
        assert (taken.status, taken.message) == (
            errors.ADDRESS, f"--http-port {port}: cannot serve HTTP on 127.0.0.1:{port}: address already in use")
    check_ports([("--http-port", "HTTP", "127.0.0.1", port), ("--grpc-port", "gRPC", "127.0.0.1", None),
                 ("--metrics-port", "metrics", "127.0.0.1", 0)])       # free again; off; any port
    twice = refusal(check_ports, [("--metrics-port", "metrics", "127.0.0.1", port),
                                  ("--grpc-port", "gRPC", "127.0.0.1", port)])
    assert (twice.status, twice.message) == (errors.USAGE, f"--grpc-port {port}: already given to --metrics-port")
    assert refusal(check_ports, [("--http-port", "HTTP", "127.0.0.1", 70000)]).message == \
        "--http-port 70000: not a port number (0-65535)"
    unknown = refusal(check_ports, [("--http-port", "HTTP", "no-such-host.invalid", 8000)])
    assert unknown.status == errors.ADDRESS
    assert unknown.message.startswith("--http-port 8000: cannot resolve host 'no-such-host.invalid': ")


def test_datatype_names_are_tritons() -> None:
    assert set(DATATYPE_NAMES) == WIRE_DATATYPES and len(DATATYPE_NAMES) == len(WIRE_DATATYPES)


def value(text: str, declared: dict | None = None):
    return input_value(parse_spec(text), declared or {})


def test_input_forms(tmp_path: Path) -> None:
    got = value("A=[[1,2,3]]:INT64")
    assert got.dtype == np.int64 and got.tolist() == [[1, 2, 3]]
    assert value("A=[[1,2]]", {"A": "INT16"}).dtype == np.int16        # the model's declared type
    assert value("A=[[1,2]]").dtype == np.float32                       # not declared: FP32
    assert value('A=["a","b"]').tolist() == ["a", "b"]                  # strings: BYTES
    assert value("A=[true,false]:bool").tolist() == [True, False]       # names are case-insensitive
    bf16 = value("A=[1.5,-2,0.1]:BF16")
    assert (bf16.datatype, bf16.shape) == ("BF16", (3,))
    assert np.frombuffer(bf16.data, np.uint16).tolist() == [0x3FC0, 0xC000, 0x3DCD]   # 0.1 rounds to nearest
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.int32).reshape(2, 3))
    from_file = value(f"A=@{tmp_path}/x.npy")
    assert from_file.dtype == np.int32 and from_file.shape == (2, 3)
    assert value(f"A=@{tmp_path}/x.npy:FP64").dtype == np.float64
    assert [s.name for s in parse_specs(["A=[1]", "B=[2]"])] == ["A", "B"]


@pytest.mark.parametrize("text, message", [
    ("A", "--input A: expected NAME=JSON[:DATATYPE] or NAME=@FILE.npy[:DATATYPE]"),
    ("=[1]", "--input =[1]: expected NAME=JSON[:DATATYPE] or NAME=@FILE.npy[:DATATYPE]"),
    ("A=[1,2", "--input A=[1,2: not valid JSON (Expecting ',' delimiter at column 5); quote it for the shell, "
               "e.g. --input 'A=[[1,2,3]]'"),
    ("A=[1]:FLOAT", "--input A=[1]:FLOAT: unknown datatype 'FLOAT' (Triton's names: BOOL, UINT8, UINT16, "
                    "UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, BF16, FP32, FP64, BYTES)"),
    ("A=[1.5]:INT32", "--input A=[1.5]:INT32: INT32 expects whole numbers"),
    ("A=[300]:UINT8", "--input A=[300]:UINT8: cannot make a tensor of UINT8 from it: "
                      "Python integer 300 out of bounds for uint8"),
    ("A=[[1],[2,3]]:FP32", "--input A=[[1],[2,3]]:FP32: cannot make a tensor of FP32 from it: "
                           "the nested lists are not all the same length"),
    ("A=[1]:BOOL", "--input A=[1]:BOOL: BOOL expects true or false"),
    ('A=["x"]:FP32', '--input A=["x"]:FP32: FP32 expects numbers, not strings'),
    ("A=[1]:BYTES", "--input A=[1]:BYTES: a BYTES tensor is made of JSON strings"),
    ("A=@/no/such.npy", "--input A=@/no/such.npy: cannot read /no/such.npy: No such file or directory"),
])
def test_input_refusals(text: str, message: str) -> None:
    refused = refusal(value, text)
    assert (refused.status, refused.message) == (errors.USAGE, message)


def test_input_files_that_are_not_plain_arrays(tmp_path: Path) -> None:
    np.save(tmp_path / "objects.npy", np.array(["a", None], dtype=object))
    refused = refusal(value, f"A=@{tmp_path}/objects.npy")
    assert refused.message.startswith(f"--input A=@{tmp_path}/objects.npy: {tmp_path}/objects.npy is not a "
                                      f"plain .npy array (")
    assert refused.message.endswith("); for BYTES give a JSON list of strings")
    (tmp_path / "text.npy").write_text("[1, 2]")
    assert "is not a plain .npy array" in refusal(value, f"A=@{tmp_path}/text.npy").message
    assert refusal(parse_specs, ["A=[1]", "A=[2]"]).message == "--input A: given twice"


def test_output_rows_use_tritons_names() -> None:
    assert output_row("O", np.array([[1, 2]], np.int8)) == {"name": "O", "datatype": "INT8", "shape": [1, 2],
                                                           "data": [1, 2]}
    assert output_row("S", np.array([b"ab", b"\xff"], dtype=object)) == {
        "name": "S", "datatype": "BYTES", "shape": [2], "data": ["ab", "\ufffd"]}
    import torch

    assert output_row("B", torch.tensor([1.5, 2.0], dtype=torch.bfloat16)) == {
        "name": "B", "datatype": "BF16", "shape": [2], "data": [1.5, 2.0]}


def test_tables_and_averages() -> None:
    assert table(("A", "LONGER", "C"), [("xyz", 1, ""), ("", 22, "last")]) == \
        "A    LONGER  C\nxyz  1\n     22      last"
    assert (average_us(0, 0), average_us(3_000_000, 3), average_us(50_000_000, 2)) == ("-", "1000 us", "25.00 ms")


def test_worker_titles() -> None:
    from types import SimpleNamespace

    from torchpool.worker.entry import worker_title

    def title(instance: str, device: str = "cpu") -> str:    # the WorkerSpec fields the title reads
        return worker_title(SimpleNamespace(model="addsub", version=1, instance=instance, device=device))

    assert title("addsub_0") == "torchpool worker addsub v1 #0"
    assert title("addsub_0_1") == "torchpool worker addsub v1 #0_1"      # Triton's name: group 0, instance 1
    assert title("fast_2", "cuda:1") == "torchpool worker addsub v1 #fast_2 cuda:1"


def test_perf_is_a_subcommand_when_its_package_is_there() -> None:
    try:
        importlib.import_module("torchpool.perf.cli")
    except ImportError:
        pytest.skip("torchpool.perf.cli is not there")
    assert "perf" in build_parser()._subparsers._group_actions[0].choices



# --- issue 26, item 6 -----------------------------------------------------------------

CLIENT_COMMANDS = ("infer", "models", "metadata", "stats", "ps")


def test_every_client_command_takes_json() -> None:
    """The README says each client command takes --json; `infer --json` was refused."""
    for command in CLIENT_COMMANDS:
        positional = ["addsub"] if command in ("infer", "metadata") else []
        args = build_parser().parse_args([command, *positional, "--json"])
        assert args.json is True, command


def run_into_a_closed_pipe(*args: str, cwd: Path) -> "subprocess.CompletedProcess":
    """`torchpool ARGS | head` when head has already gone: stdout's reader is closed."""
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "torchpool", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, cwd=cwd, timeout=60)
    finally:
        os.close(write)


def test_a_reader_that_goes_away_is_no_traceback(tmp_path: Path) -> None:
    done = run_into_a_closed_pipe("keygen", str(tmp_path / "keys"), cwd=Path(__file__).resolve().parents[2])
    assert done.stderr == ""                            # no BrokenPipeError traceback
    assert done.returncode == errors.READER_GONE == 141   # what the shell shows for SIGPIPE


def test_ps_formats() -> None:
    from torchpool.cli.client_commands import duration, instance_rows, size

    assert [duration(s) for s in (0.4, 42, 725, 11_220, 190_000)] == ["0s", "42s", "12m05s", "3h07m", "2d04h"]
    assert [size(n) for n in (None, 35 << 20, 3 << 30)] == ["-", "35.0 MiB", "3.00 GiB"]
    stats = {"model_stats": [{"name": "a", "version": "1", "instances": [{"name": "a_0", "pid": 7}]},
                             {"name": "b", "version": "2"}]}
    assert instance_rows(stats) == [{"model": "a", "version": "1", "name": "a_0", "pid": 7}]
