"""scripts/triton_qa.py (Triton's qa/L0_infer against torchpool): its command line,
how it takes Triton's QA sources and builds the model repository the way test.sh
does, and how it reads unittest's report. The QA run itself needs a Triton
checkout and is documented in docs/triton-qa.md."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "triton_qa.py"
_spec = importlib.util.spec_from_file_location("triton_qa", SCRIPT)
triton_qa = importlib.util.module_from_spec(_spec)
sys.modules["triton_qa"] = triton_qa      # its dataclasses look their module up while it loads
_spec.loader.exec_module(triton_qa)

# the lines of Triton's qa/common that name the ports (infer_util.py, shm_util.py)
INFER_UTIL = ('configs.append((f"{_tritonserver_ipaddr}:8000", "http", False, True))\n'
              'configs.append((f"{_tritonserver_ipaddr}:8001", "grpc", False, False))\n')
SHM_UTIL = 'triton_client = httpclient.InferenceServerClient(f"{_tritonserver_ipaddr}:8000")\n'


def test_help_runs_without_torch_or_a_triton_tree() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--triton-server", "--http-port", "--grpc-port", "--config", "--test", "--log-dir"):
        assert flag in r.stdout


def test_defaults_are_tritons_ports_and_both_configurations() -> None:
    args = triton_qa.parse_args(["--triton-server", "/x"])
    assert (args.http_port, args.grpc_port) == (8000, 8001)
    assert args.configs == ["no-shm", "system-shm"]
    assert args.tests is None and args.triton_ref == "HEAD"
    assert triton_qa.parse_args(["--triton-server", "/x", "--config", "system-shm"]).configs == ["system-shm"]


@pytest.mark.parametrize("argv, message", [
    ([], "--triton-server"),
    (["--http-port", "0"], "--http-port must be a TCP port"),
    (["--grpc-port", "70000"], "--grpc-port must be a TCP port"),
    (["--http-port", "9000", "--grpc-port", "9000"], "must differ"),
    (["--config", "cuda-shm"], "invalid choice: 'cuda-shm'"),
])
def test_bad_arguments_are_refused_naming_the_flag(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    base = [] if not argv else ["--triton-server", "/x"]
    with pytest.raises(SystemExit) as e:
        triton_qa.parse_args(base + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _qa_tree(root: Path, gen_script: str = "") -> Path:
    (root / "qa" / "common").mkdir(parents=True)
    (root / "qa" / "L0_infer").mkdir(parents=True)
    (root / "qa" / "common" / "infer_util.py").write_text(INFER_UTIL)
    (root / "qa" / "common" / "shm_util.py").write_text(SHM_UTIL)
    (root / "qa" / "common" / "gen_qa_models.py").write_text(gen_script)
    (root / "qa" / "L0_infer" / "infer_test.py").write_text("# the tests\n")
    (root / "qa" / "L0_other").mkdir()
    return root


def test_qa_sources_come_from_a_tree(tmp_path: Path) -> None:
    tree = _qa_tree(tmp_path / "server")
    described = triton_qa.extract_qa(tree, "HEAD", tmp_path / "work")
    assert described == str(tree.resolve())
    assert (tmp_path / "work/qa/L0_infer/infer_test.py").read_text() == "# the tests\n"
    assert not (tmp_path / "work/qa/L0_other").exists()     # only what L0_infer uses


def test_qa_sources_come_from_a_bare_git_repository(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    tree = _qa_tree(tmp_path / "server")
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "qa"], check=True)
    bare = tmp_path / "server.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(tree), str(bare)], check=True)
    described = triton_qa.extract_qa(bare, "HEAD", tmp_path / "work")
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    assert described == f"{bare.resolve()} at {commit.strip()}"
    assert (tmp_path / "work/qa/common/shm_util.py").read_text() == SHM_UTIL
    with pytest.raises(triton_qa.QaError, match="not a git repository with 'no-such-ref'"):
        triton_qa.extract_qa(bare, "no-such-ref", tmp_path / "work2")


def test_a_directory_without_qa_is_refused(tmp_path: Path) -> None:
    with pytest.raises(triton_qa.QaError, match="holds no qa/ directory"):
        triton_qa.extract_qa(tmp_path, "HEAD", tmp_path / "work")


def test_other_ports_are_written_into_the_copy_only_when_asked(tmp_path: Path) -> None:
    common = _qa_tree(tmp_path) / "qa" / "common"
    triton_qa.point_at_ports(common, 8000, 8001)
    assert (common / "infer_util.py").read_text() == INFER_UTIL
    triton_qa.point_at_ports(common, 18000, 18001)
    assert (common / "infer_util.py").read_text() == INFER_UTIL.replace(":8000", ":18000").replace(":8001", ":18001")
    assert (common / "shm_util.py").read_text() == SHM_UTIL.replace(":8000", ":18000")
    # a QA that no longer hardcodes the port is not silently left pointing elsewhere
    with pytest.raises(triton_qa.QaError, match="no longer hardcodes :8000"):
        triton_qa.point_at_ports(common, 19000, 18001)


FAKE_GEN = """import argparse, os
p = argparse.ArgumentParser(); p.add_argument("--models_dir"); p.add_argument("--libtorch", action="store_true")
a = p.parse_args()
assert a.libtorch
for name in ("libtorch_int32_int32_int32", "libtorch_nobatch_int32_int32_int32", "onnx_int32_int32_int32"):
    os.makedirs(f"{a.models_dir}/{name}/1")
    open(f"{a.models_dir}/{name}/config.pbtxt", "w").write(f'name: "{name}"\\n')
"""


def test_repository_is_the_libtorch_models_with_test_sh_cpu_instance_groups(tmp_path: Path) -> None:
    qa = _qa_tree(tmp_path / "src", FAKE_GEN) / "qa"
    work = tmp_path / "work"
    work.mkdir()
    names = triton_qa.build_repository(qa, work)
    assert names == ["libtorch_int32_int32_int32", "libtorch_nobatch_int32_int32_int32"]
    assert sorted(p.name for p in (work / "models").iterdir()) == names
    assert (work / "models" / names[0] / "config.pbtxt").read_text() == \
        f'name: "{names[0]}"\ninstance_group [ {{ kind: KIND_CPU }}]\n'


def test_a_failing_generator_is_reported_with_its_output(tmp_path: Path) -> None:
    qa = _qa_tree(tmp_path / "src", "import onnx_not_here\n") / "qa"
    with pytest.raises(triton_qa.QaError, match="(?s)gen_qa_models.py --libtorch failed.*onnx_not_here"):
        triton_qa.build_repository(qa, tmp_path)


UNITTEST_REPORT = """test_class_bbb (__main__.InferTest.test_class_bbb) ... ok
test_raw_fff (__main__.InferTest.test_raw_fff) ... FAIL
test_raw_iii (__main__.InferTest.test_raw_iii) ... ERROR
test_raw_uuu (__main__.InferTest.test_raw_uuu) ... skipped 'no uint8'

======================================================================
FAIL: test_raw_fff (__main__.InferTest.test_raw_fff)
----------------------------------------------------------------------
AssertionError: False is not true

----------------------------------------------------------------------
Ran 4 tests in 1.250s

FAILED (failures=1, errors=1, skipped=1)
"""


def test_unittest_report_gives_counts_names_and_tracebacks() -> None:
    r = triton_qa.RunResult("no-shm", 41)
    triton_qa.parse_unittest(UNITTEST_REPORT, r)
    assert (r.ran, r.failures, r.errors, r.skipped, r.passed) == (4, 1, 1, 1, 1)
    assert r.not_ok == ["test_raw_fff: FAIL", "test_raw_iii: ERROR", "test_raw_uuu: skipped 'no uint8'"]
    assert "AssertionError: False is not true" in r.report and not r.ok
    text = triton_qa.summary([r], "server at abc")
    assert "no-shm: ran 4 tests, test.sh's count for this setup is 41" in text
    assert text.endswith("FAILED")


def test_a_full_pass_with_the_expected_count_is_ok() -> None:
    r = triton_qa.RunResult("system-shm", 29, requests=(136, 0, 25))
    triton_qa.parse_unittest("Ran 29 tests in 7.0s\n\nOK\n", r)
    assert r.ok and r.passed == 29
    assert triton_qa.summary([r], "server").endswith("PASSED")
    short = triton_qa.RunResult("system-shm", 29)
    triton_qa.parse_unittest("Ran 28 tests in 7.0s\n\nOK\n", short)
    assert not short.ok                       # a test that silently vanished is a failure
    crashed = triton_qa.RunResult("no-shm", 41)
    triton_qa.parse_unittest("Traceback ...\nImportError: no module named infer_util\n", crashed)
    assert not crashed.ok and "no unittest summary" in crashed.problems[0]
