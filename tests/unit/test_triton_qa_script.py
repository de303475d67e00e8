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
    for flag in ("--triton-server", "--suite", "--http-port", "--grpc-port", "--config", "--test", "--log-dir"):
        assert flag in r.stdout


def test_defaults_are_tritons_ports_and_both_configurations() -> None:
    args = triton_qa.parse_args(["--triton-server", "/x"])
    assert (args.http_port, args.grpc_port) == (8000, 8001)
    assert args.configs == ["no-shm", "system-shm"]
    assert args.tests is None and args.triton_ref == "HEAD"
    assert args.suite == "L0_infer"
    # the batcher suites run once, without shared memory, as their test.sh does by default
    assert triton_qa.parse_args(["--triton-server", "/x", "--suite", "L0_batcher"]).configs == ["no-shm"]
    assert triton_qa.parse_args(["--triton-server", "/x", "--config", "system-shm"]).configs == ["system-shm"]


@pytest.mark.parametrize("argv, message", [
    ([], "--triton-server"),
    (["--http-port", "0"], "--http-port must be a TCP port"),
    (["--grpc-port", "70000"], "--grpc-port must be a TCP port"),
    (["--http-port", "9000", "--grpc-port", "9000"], "must differ"),
    (["--config", "cuda-shm"], "invalid choice: 'cuda-shm'"),
    (["--suite", "L0_dlpack"], "invalid choice: 'L0_dlpack'"),
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
    qa = _qa_tree(tmp_path) / "qa"
    common = qa / "common"
    triton_qa.point_at_ports(qa, 8000, 8001)
    assert (common / "infer_util.py").read_text() == INFER_UTIL
    triton_qa.point_at_ports(qa, 18000, 18001)
    assert (common / "infer_util.py").read_text() == INFER_UTIL.replace(":8000", ":18000").replace(":8001", ":18001")
    assert (common / "shm_util.py").read_text() == SHM_UTIL.replace(":8000", ":18000")
    # a QA that no longer hardcodes the port is not silently left pointing elsewhere
    with pytest.raises(triton_qa.QaError, match="no longer hardcodes :8000"):
        triton_qa.point_at_ports(qa, 19000, 18001)


def test_the_sequence_suite_s_ports_are_moved_in_each_of_its_files(tmp_path: Path) -> None:
    qa = tmp_path / "qa"
    (qa / "common").mkdir(parents=True)
    (qa / "L0_sequence_batcher").mkdir()
    test = 'self.server_address_ = (\n    os.environ.get("TRITONSERVER_IPADDR", "localhost") + ":8001"\n)\n'
    (qa / "L0_sequence_batcher" / "sequence_batcher_test.py").write_text(test)
    (qa / "common" / "sequence_util.py").write_text(INFER_UTIL)
    triton_qa.point_at_ports(qa, 18000, 18001, triton_qa.SUITES["L0_sequence_batcher"].port_files)
    assert (qa / "L0_sequence_batcher" / "sequence_batcher_test.py").read_text() == test.replace("8001", "18001")
    assert ":18000" in (qa / "common" / "sequence_util.py").read_text()


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


# ------------------------------------------------------------------ the batcher suites

FAKE_GENERATORS = {
    "gen_qa_models.py": """import argparse, os
p = argparse.ArgumentParser(); p.add_argument("--models_dir"); p.add_argument("--libtorch", action="store_true")
p.add_argument("--variable", action="store_true")
a = p.parse_args()
name = "libtorch_float32_float32_float32"
os.makedirs(f"{a.models_dir}/{name}/1")
dims = "-1" if a.variable else "16"
open(f"{a.models_dir}/{name}/config.pbtxt", "w").write(
    f'name: "{name}"\\nmax_batch_size: 8\\nversion_policy: {{ latest {{ num_versions: 1 }}}}\\n'
    f'input [ {{ name: "INPUT0" dims: [ {dims} ] }} ]\\n')
""",
    "gen_qa_identity_models.py": """import argparse, os
p = argparse.ArgumentParser(); p.add_argument("--models_dir"); p.add_argument("--libtorch", action="store_true")
a = p.parse_args()
name = "libtorch_nobatch_zero_1_float32"
os.makedirs(f"{a.models_dir}/{name}/1")
open(f"{a.models_dir}/{name}/config.pbtxt", "w").write(
    f'name: "{name}"\\nmax_batch_size: 0\\ninput [ {{ name: "INPUT__0" dims: [ -1 ] }} ]\\n')
""",
    "gen_qa_sequence_models.py": """import argparse, os
p = argparse.ArgumentParser(); p.add_argument("--models_dir"); p.add_argument("--libtorch", action="store_true")
p.add_argument("--variable", action="store_true")
a = p.parse_args()
for dtype in ("int32", "bool", "float32"):
    for name in (f"libtorch_sequence_{dtype}", f"libtorch_nobatch_sequence_{dtype}"):
        if a.variable and "nobatch" in name:
            continue
        os.makedirs(f"{a.models_dir}/{name}/1")
        mbs = 0 if "nobatch" in name else 8
        open(f"{a.models_dir}/{name}/config.pbtxt", "w").write(
            f'name: "{name}"\\nmax_batch_size: {mbs}\\n'
            f'sequence_batching {{\\n  max_sequence_idle_microseconds: 5000000\\n}}\\n'
            f'instance_group [\\n  {{\\n    kind: KIND_GPU\\n  }}\\n]\\n')
""",
}


def _generators(root: Path) -> Path:
    qa = root / "qa"
    (qa / "common").mkdir(parents=True)
    for name, text in FAKE_GENERATORS.items():
        (qa / "common" / name).write_text(text)
    return qa


def test_batcher_repositories_are_test_sh_s(tmp_path: Path) -> None:
    qa = _generators(tmp_path / "src")
    work = tmp_path / "work"
    work.mkdir()
    repos = triton_qa.build_batcher_repositories(qa, work)
    assert repos == {"models": ["libtorch_float32_float32_float32"],
                     "preferred_batch_only_models": ["libtorch_float32_float32_float32"],
                     "var_models": ["custom_zero_1_float32", "libtorch_float32_float32_float32",
                                    "libtorch_zero_1_float32"]}
    fixed = (work / "models/libtorch_float32_float32_float32/config.pbtxt").read_text()
    assert fixed == ('name: "libtorch_float32_float32_float32"\nmax_batch_size: 8\n'
                     'version_policy: { specific { versions: [1] }}\ninput [ { name: "INPUT0" dims: [ 16 ] } ]\n'
                     'dynamic_batching { preferred_batch_size: [ 2, 6 ], max_queue_delay_microseconds: 10000000 }\n')
    only = (work / "preferred_batch_only_models/libtorch_float32_float32_float32/config.pbtxt").read_text()
    assert only.endswith("dynamic_batching { preferred_batch_size: [ 4, 6 ] }\n")
    variable = (work / "var_models/libtorch_float32_float32_float32/config.pbtxt").read_text()
    assert "dims: [ -1 ]" in variable and "10000000" in variable      # s/16/-1/g spares the delay
    for name in ("libtorch_zero_1_float32", "custom_zero_1_float32"):
        zero = (work / "var_models" / name / "config.pbtxt").read_text()
        assert zero.startswith(f'name: "{name}"\nmax_batch_size: 8\n')
        assert 'name: "INPUT__0"\nallow_ragged_batch: true dims: [ -1 ]' in zero
        assert 'kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT__0" }] dynamic_batching' in zero


def test_sequence_repositories_are_test_sh_s_on_the_cpu(tmp_path: Path) -> None:
    qa = _generators(tmp_path / "src")
    work = tmp_path / "work"
    work.mkdir()
    repos = triton_qa.build_sequence_repositories(qa, work)
    pair = ["libtorch_sequence_bool", "libtorch_sequence_int32"]
    assert repos["models1"] == repos["models2"] == repos["models4"] == repos["modelsv"] == pair
    assert repos["models0"] == ["libtorch_nobatch_sequence_bool", "libtorch_nobatch_sequence_int32"]
    assert repos["queue_delay_models"] == sorted(pair + [f"{n}_{v}" for n in pair for v in ("full", "half")])
    for repo, mbs, count in (("models1", 4, 1), ("models2", 2, 2), ("models4", 1, 4), ("modelsv", 4, 1),
                             ("models0", 0, 4)):
        name = repos[repo][1]
        config = (work / repo / name / "config.pbtxt").read_text()
        assert f"max_batch_size: {mbs}\n" in config, repo
        assert f"kind: KIND_CPU\ncount: {count}\n" in config and "KIND_GPU" not in config, repo
    half = (work / "queue_delay_models/libtorch_sequence_int32_half/config.pbtxt").read_text()
    assert half.startswith('name: "libtorch_sequence_int32_half"\n')
    assert ("sequence_batching {\ndirect {\nmax_queue_delay_microseconds: 3000000\n"
            "minimum_slot_utilization: 0.5\n}\n") in half
    full = (work / "queue_delay_models/libtorch_sequence_int32_full/config.pbtxt").read_text()
    assert "minimum_slot_utilization: 1\n" in full


def test_each_batcher_test_runs_against_its_own_daemon_with_test_sh_s_switches() -> None:
    batcher = triton_qa.SUITES["L0_batcher"].cases(["no-shm"])
    sequence = triton_qa.SUITES["L0_sequence_batcher"].cases(["no-shm"])
    assert (len(batcher), len(sequence)) == (39, 88)
    assert all(c.expected == 1 and len(c.tests) == 1 for c in batcher + sequence)
    by_name = {c.name: c for c in batcher + sequence}
    assert len(by_name) == 39 + 88
    delays = ("TRITONSERVER_DELAY_SCHEDULER", "TRITONSERVER_BACKLOG_DELAY_SCHEDULER")

    def switches(name: str) -> tuple:
        return tuple(by_name[name].env.get(k) for k in delays)

    assert switches("test_static_batch_preferred.FIXED") == (None, None)
    assert switches("test_multi_batch_use_biggest_preferred.VARIABLE") == ("6", None)
    assert switches("test_preferred_batch_only_unaligned.PREFERRED_BATCH_ONLY") == ("5", None)
    assert by_name["test_preferred_batch_only_unaligned.PREFERRED_BATCH_ONLY"].repository == \
        "preferred_batch_only_models"
    assert switches("test_backlog_fill.models1") == ("10", "2")
    assert switches("test_backlog_fill_no_end.models4") == ("10", "3")
    assert switches("test_backlog_same_correlation_id_no_end.models2") == ("16", "0")
    assert switches("test_half_batch.models0") == ("8", "0")
    assert switches("test_simple_sequence.modelsv") == (None, None)
    assert switches("test_queue_delay_half_min_util.queue_delay_models") == ("2", "0")
    assert {k: by_name["test_backlog.models0"].env[k] for k in ("NO_BATCHING", "MODEL_INSTANCES", "BATCHER_TYPE")} \
        == {"NO_BATCHING": "1", "MODEL_INSTANCES": "4", "BATCHER_TYPE": "FIXED"}
    assert by_name["test_backlog.modelsv"].env["BATCHER_TYPE"] == "VARIABLE"
    assert by_name["test_backlog.models1"].tests == ["SequenceBatcherTest.test_backlog"]


def test_tests_are_chosen_by_name_or_by_run() -> None:
    suite = triton_qa.SUITES["L0_sequence_batcher"]
    assert [c.name for c in triton_qa.select_cases(suite, ["no-shm"], ["SequenceBatcherTest.test_backlog"])] == \
        [f"test_backlog.models{t}" for t in "0124v"]
    assert [c.name for c in triton_qa.select_cases(suite, ["no-shm"], ["test_half_batch.models2"])] == \
        ["test_half_batch.models2"]
    with pytest.raises(triton_qa.QaError, match="has no run test_nothing"):
        triton_qa.select_cases(suite, ["no-shm"], ["test_nothing"])
    infer = triton_qa.select_cases(triton_qa.SUITES["L0_infer"], ["no-shm"], ["InferTest.test_raw_fff"])
    assert [(c.name, c.tests, c.expected) for c in infer] == [("no-shm", ["InferTest.test_raw_fff"], None)]


def test_the_delay_switches_come_from_test_sh_never_from_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITONSERVER_DELAY_SCHEDULER", "99")
    monkeypatch.setenv("TRITONSERVER_BACKLOG_DELAY_SCHEDULER", "99")
    env = triton_qa.clean_environment({"TRITONSERVER_DELAY_SCHEDULER": "3"})
    assert env["TRITONSERVER_DELAY_SCHEDULER"] == "3" and "TRITONSERVER_BACKLOG_DELAY_SCHEDULER" not in env
    assert "TRITONSERVER_DELAY_SCHEDULER" not in triton_qa.clean_environment({})


def test_the_daemon_allows_client_shared_memory_only_for_shared_memory_runs(tmp_path: Path) -> None:
    command = triton_qa.serve_command(tmp_path / "models", tmp_path, 8000, 8001, {"TEST_SYSTEM_SHARED_MEMORY": "1"})
    assert command[1:4] == ["-m", "torchpool", "serve"] and command[-1] == "--allow-client-shm=true"
    assert f"ipc://{tmp_path}/torchpool.sock" in command
    plain = triton_qa.serve_command(tmp_path / "models", tmp_path, 8000, 8001, {"TEST_SYSTEM_SHARED_MEMORY": "0"})
    assert not any("allow-client-shm" in a for a in plain)


# ------------------------------------------------------------------ L0_shared_memory, L0_http, L0_grpc

def test_shared_memory_runs_are_test_sh_s_for_each_client_type() -> None:
    cases = triton_qa.SUITES["L0_shared_memory"].cases(["no-shm"])
    # 1 test without --allow-client-shm, 17 with, the large-offset test: each over http and grpc
    assert len(cases) == 2 * (1 + 17 + 1)
    by_name = {c.name: c for c in cases}
    disabled = by_name["test_client_shm_disabled_by_default.http"]
    assert disabled.serve_args == [] and disabled.env == {"CLIENT_TYPE": "http"}
    allowed = by_name["test_register_out_of_bound.grpc"]
    assert allowed.serve_args == ["--allow-client-shm=true"] and allowed.env == {"CLIENT_TYPE": "grpc"}
    assert allowed.tests == ["SharedMemoryTest.test_register_out_of_bound"] and allowed.expected == 1
    assert by_name["test_large_shm_register_offset.http"].repository == "offset_models"
    assert {c.repository for c in cases} == {"models", "offset_models"}
    # the Python-backend model's TestSharedMemoryUnregister runs are not among them
    assert not any("during_inference" in c.name for c in cases)
    chosen = triton_qa.select_cases(triton_qa.SUITES["L0_shared_memory"], ["no-shm"], ["test_unregisterall"])
    assert [c.name for c in chosen] == ["test_unregisterall.http", "test_unregisterall.grpc"]


def test_a_run_s_server_arguments_follow_the_repository_and_ports(tmp_path: Path) -> None:
    command = triton_qa.serve_command(tmp_path / "models", tmp_path, 8000, 8001, {}, ["--allow-client-shm=true"])
    assert command[-1] == "--allow-client-shm=true" and command.count("--allow-client-shm=true") == 1


def test_gateway_suites_run_whole_files_with_test_sh_s_counts() -> None:
    http = triton_qa.SUITES["L0_http"].cases(["no-shm"])
    assert [(c.name, c.repository, c.expected, c.serve_args, c.test_file) for c in http] == \
        [("python_http_aio_test", "models", 18, ["--allow-client-shm=true"], None),
         ("http_test", "python_unit_test_models", 16, ["--model-control-mode=explicit", "--load-model=*"],
          "L0_http/http_test.py")]
    # http_test.py's 17 tests but the one that sends a ~2.9 GB body, named so
    assert http[0].tests == [] and len(http[1].tests) == 16 == len(set(http[1].tests))
    assert all(t.startswith("HttpTest.test_") for t in http[1].tests)
    assert "HttpTest.test_loading_large_invalid_model" not in http[1].tests
    assert "HttpTest.test_negative_dimensions" in http[1].tests
    grpc = triton_qa.SUITES["L0_grpc"].cases(["no-shm"])
    assert [(c.name, c.repository, c.tests, c.expected, c.test_file) for c in grpc] == \
        [("GrpcTest", "grpc_test_models", ["GrpcTest"], 2, None),
         ("python_grpc_aio_test", "models", [], 18, "L0_grpc/python_grpc_aio_test.py")]
    assert [c.name for c in triton_qa.select_cases(triton_qa.SUITES["L0_grpc"], ["no-shm"],
                                                   ["python_grpc_aio_test"])] == ["python_grpc_aio_test"]


def test_string_stand_ins_take_one_string_per_batch_item(tmp_path: Path) -> None:
    config = tmp_path / "config.pbtxt"
    config.write_text('max_batch_size: 8\ninput [\n  {\n    name: "INPUT0"\n    data_type: TYPE_STRING\n'
                      '    dims: [ -1 ]\n  }\n]\noutput [\n  {\n    name: "OUTPUT0"\n'
                      '    data_type: TYPE_STRING\n    dims: [ 1 ]\n  }\n]\nother [ {\n'
                      '    data_type: TYPE_FP32\n    dims: [ -1 ]\n } ]\n')
    triton_qa.one_string_per_item(config)
    text = config.read_text()
    assert text.count("dims: [ 1 ]\n    reshape: { shape: [ ] }") == 2
    assert "data_type: TYPE_FP32\n    dims: [ -1 ]\n" in text


def test_localhost_ports_are_moved_too(tmp_path: Path) -> None:
    qa = tmp_path / "qa"
    (qa / "L0_grpc").mkdir(parents=True)
    text = 'c = InferenceServerClient(url="localhost:8001")\ngrpc.insecure_channel("localhost:8001", options=o)\n'
    (qa / "L0_grpc" / "python_unit_test.py").write_text(text)
    triton_qa.point_at_ports(qa, 18000, 18001, {"L0_grpc/python_unit_test.py": (8001,)})
    assert (qa / "L0_grpc" / "python_unit_test.py").read_text() == text.replace(":8001", ":18001")


def test_the_psutil_stand_in_reports_this_process_s_memory(tmp_path: Path) -> None:
    (tmp_path / "psutil.py").write_text(triton_qa.PSUTIL_SHIM)
    r = subprocess.run([sys.executable, "-c", "import psutil; m = psutil.Process().memory_info(); "
                        "print(m.rss, m.vms)"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    rss, vms = map(int, r.stdout.split())
    assert 1 << 20 < rss <= vms


def test_the_shared_memory_suite_s_regions_are_checked_for_leftovers() -> None:
    for name in ("input0_data", "output1_data", "dummy_data", "shmtest", "input0", "op10_data"):
        assert triton_qa.QA_SHM_REGION.match(name), name
    assert not triton_qa.QA_SHM_REGION.match("torchpool.x.1.arena")


# ------------------------------------------------------------------ L0_lifecycle, L0_implicit_state

def _generated(work: Path, repository: str, name: str, versions: tuple[str, ...] = ("1", "2", "3"),
               extra: str = "") -> Path:
    """A model as qa/common's generators write it (found there, generate() runs nothing)."""
    model = work / repository / name
    for v in versions:
        (model / v).mkdir(parents=True)
        (model / v / "model.pt").write_bytes(b"pt")
    (model / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
        f'version_policy: {{ latest {{ num_versions: 2 }}}}\n'
        f'output [ {{ name: "OUTPUT__0" label_filename: "output0_labels.txt" }} ]\n'
        f'instance_group [ {{ kind: KIND_GPU }} ]\n{extra}')
    (model / "output0_labels.txt").write_text("label0\nlabel1\n")
    return model


def test_lifecycle_runs_are_test_sh_s_libtorch_cases_each_on_its_own_server() -> None:
    cases = triton_qa.SUITES["L0_lifecycle"].cases(["no-shm"])
    by_name = {c.name: c for c in cases}
    assert set(by_name) == {"test_parse_ignore_zero_prefixed_version", "test_parse_ignore_non_intergral_version",
                            "test_dynamic_model_load_unload", "test_dynamic_model_load_unload_disabled",
                            "test_dynamic_version_load_unload", "test_dynamic_version_load_unload_disabled",
                            "test_dynamic_model_modify"}
    for c in cases:
        assert c.tests == [f"LifeCycleTest.{c.name}"] and c.expected == 1 and c.setup is not None
        assert c.repository == "qa/L0_lifecycle/models"
    assert by_name["test_dynamic_version_load_unload"].serve_args == \
        ["--repository-poll-secs=1", "--model-control-mode=poll"]
    assert by_name["test_dynamic_model_load_unload_disabled"].serve_args == ["--model-control-mode=none"]
    assert by_name["test_parse_ignore_zero_prefixed_version"].log_expect == \
        ("ignore version directory '003' which contains leading zeros in its directory name",)
    # test.sh's --exit-timeout-secs is not a torchpool flag
    assert not any("exit-timeout" in a for c in cases for a in c.serve_args)


def test_lifecycle_setups_make_test_sh_s_models_afresh(tmp_path: Path) -> None:
    _generated(tmp_path, "qa_model_repository", "libtorch_float32_float32_float32")
    _generated(tmp_path, "qa_model_repository", "libtorch_int32_int32_int32")
    (tmp_path / "qa" / "L0_lifecycle").mkdir(parents=True)
    here = tmp_path / "qa" / "L0_lifecycle"
    cases = {c.name: c for c in triton_qa.SUITES["L0_lifecycle"].cases(["no-shm"])}

    cases["test_parse_ignore_zero_prefixed_version"].setup(tmp_path)
    model = here / "models" / "libtorch_float32_float32_float32"
    assert sorted(p.name for p in model.iterdir() if p.is_dir()) == ["003", "1", "2"]
    assert "KIND_CPU" in (model / "config.pbtxt").read_text()

    # the next run starts from nothing: rm -fr models libtorch_float32_float32_float32
    cases["test_dynamic_model_load_unload"].setup(tmp_path)
    assert sorted(p.name for p in (here / "models").iterdir()) == ["onnx_float32_float32_float32"]
    stand_in = (here / "models" / "onnx_float32_float32_float32" / "config.pbtxt").read_text()
    assert stand_in.startswith('name: "onnx_float32_float32_float32"\n')
    assert (here / "libtorch_float32_float32_float32" / "3" / "model.pt").is_file()   # copied in by the test

    cases["test_dynamic_version_load_unload"].setup(tmp_path)
    assert sorted(p.name for p in (here / "models").iterdir()) == ["libtorch_int32_int32_int32"]
    assert not (here / "libtorch_float32_float32_float32").exists()

    cases["test_dynamic_model_modify"].setup(tmp_path)
    assert sorted(p.name for p in (here / "models").iterdir()) == \
        ["libtorch_float32_float32_float32", "plan_float32_float32_float32"]
    for backend in ("libtorch", "plan"):
        plain = (here / f"config.pbtxt.{backend}").read_text()
        assert "version_policy" not in plain and f'name: "{backend}_float32_float32_float32"' in plain
        wrong = (here / f"config.pbtxt.wrong.{backend}").read_text()
        assert 'label_filename: "wrong_output0_labels.txt"' in wrong and "version_policy" in wrong
        labels = here / "models" / f"{backend}_float32_float32_float32" / "wrong_output0_labels.txt"
        assert labels.read_text() == "label90\nlabel91\n"
    cases["test_dynamic_version_load_unload"].setup(tmp_path)
    assert not list(here.glob("config.pbtxt.*"))


def test_a_line_test_sh_greps_for_must_be_in_the_daemon_s_log(tmp_path: Path) -> None:
    log = tmp_path / "torchpool.log"
    log.write_text("W ignore version directory 'abc' which fails to convert to integral number (model ...)\n")
    assert triton_qa.missing_log_lines(log, ("ignore version directory 'abc' which fails to convert",)) == []
    missing = triton_qa.missing_log_lines(log, ("ignore version directory '003'",))
    assert len(missing) == 1 and "'003'" in missing[0]
    assert triton_qa.missing_log_lines(tmp_path / "absent.log", ()) == []


def test_implicit_state_serves_the_libtorch_model_and_its_output_copy(tmp_path: Path) -> None:
    _generated(tmp_path, "qa_sequence_implicit_model_repository", "libtorch_nobatch_sequence_int32", ("1",))
    names = triton_qa.build_implicit_state_repositories(tmp_path / "qa", tmp_path)
    assert names == {"implicit_models": ["libtorch_nobatch_sequence_int32",
                                         "libtorch_nobatch_sequence_int32_output"]}
    config = (tmp_path / "implicit_models" / "libtorch_nobatch_sequence_int32_output" / "config.pbtxt").read_text()
    assert config.startswith('name: "libtorch_nobatch_sequence_int32_output"\n')
    assert config.endswith('output [{ name: "OUTPUT_STATE__1" \n data_type: TYPE_INT32 \n dims: [ 1 ] }]\n')
    [case] = triton_qa.SUITES["L0_implicit_state"].cases(["no-shm"])
    assert case.tests == ["ImplicitStateTest.test_request_output_not_allowed", "ImplicitStateTest.test_request_output"]
    assert case.expected == 2 and triton_qa.SUITES["L0_implicit_state"].environment["IMPLICIT_STATE"] == "1"
